"""Benchmark: token-frequency counting + draft vocab map at production scale.

Default: target vocab 163840 (Kimi-K2.5) -> draft vocab 32000 over 17M loss-masked tokens
(synthetic Zipf-distributed ids, in samples of ~2K tokens with ~60% of positions loss-masked,
like real shards). Times :func:`eagle3.data.vocab.count_token_freq` + :func:`build_vocab_map` +
:func:`coverage` (data generation is timed separately) and prints a Markdown line and JSON.

    python bench/vocab_map_speed.py [--vocab 163840 --draft 32000 --tokens 17000000 --json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle3.data.vocab import build_vocab_map, count_token_freq, coverage  # noqa: E402
from eagle3.io import atomic_write_json  # noqa: E402


def synthetic_samples(
    vocab: int, masked_tokens: int, sample_len: int, mask_frac: float, zipf_s: float, seed: int
):
    """Zipf(s) ids over a random permutation of the vocab, cut into ``sample_len`` samples.

    Returns a list of ``{"input_ids": int64 [L], "loss_mask": int64 [L]}`` whose masks sum to
    about ``masked_tokens``.
    """
    g = torch.Generator().manual_seed(seed)
    ranks = torch.arange(1, vocab + 1, dtype=torch.float64)
    cdf = torch.cumsum(ranks.pow(-zipf_s), 0)  # [V]
    cdf /= cdf[-1].clone()
    perm = torch.randperm(vocab, generator=g)  # rank -> token id
    total = int(masked_tokens / mask_frac)
    u = torch.rand(total, generator=g, dtype=torch.float64)  # [T]
    ids = perm[torch.searchsorted(cdf, u).clamp_(max=vocab - 1)]  # [T]
    mask = (torch.rand(total, generator=g) < mask_frac).to(torch.int64)  # [T]
    return [
        {"input_ids": ids[i : i + sample_len], "loss_mask": mask[i : i + sample_len]}
        for i in range(0, total, sample_len)
    ]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=163840)
    p.add_argument("--draft", type=int, default=32000)
    p.add_argument("--tokens", type=int, default=17_000_000, help="loss-masked tokens")
    p.add_argument("--sample-len", type=int, default=2048)
    p.add_argument("--mask-frac", type=float, default=0.6)
    p.add_argument("--zipf", type=float, default=1.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="also write the result here")
    a = p.parse_args(argv)

    t0 = time.perf_counter()
    samples = synthetic_samples(a.vocab, a.tokens, a.sample_len, a.mask_frac, a.zipf, a.seed)
    t_gen = time.perf_counter() - t0

    t0 = time.perf_counter()
    freq = count_token_freq(samples, a.vocab)  # [V]
    t_count = time.perf_counter() - t0
    t0 = time.perf_counter()
    d2t, t2d = build_vocab_map(freq, a.draft)
    cov = coverage(freq, t2d)
    t_map = time.perf_counter() - t0

    res = {
        "target_vocab_size": a.vocab,
        "draft_vocab_size": int(d2t.numel()),
        "samples": len(samples),
        "tokens": int(sum(s["input_ids"].numel() for s in samples)),
        "loss_masked_tokens": int(freq.sum()),
        "generate_s": round(t_gen, 3),
        "count_s": round(t_count, 3),
        "build_map_s": round(t_map, 3),
        "total_s": round(t_count + t_map, 3),
        "masked_tokens_per_s": round(int(freq.sum()) / max(t_count + t_map, 1e-9)),
        "coverage": round(cov, 6),
        "torch_threads": torch.get_num_threads(),
    }
    print("| target V | draft V | masked tokens | count s | map s | total s | coverage |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    print(
        f"| {a.vocab} | {res['draft_vocab_size']} | {res['loss_masked_tokens']} | {res['count_s']} | "
        f"{res['build_map_s']} | {res['total_s']} | {res['coverage']:.4f} |"
    )
    print(json.dumps(res))
    if a.json:
        atomic_write_json(a.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
