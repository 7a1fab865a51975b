"""Benchmark: stage 02 tokenization + loss masks, conversations/s at 1 worker and at N workers.

Times :func:`eagle3.stages.extract.tokenize_prompts` (the exact code stage 02 runs: chat template,
turn-prefix loss mask, recorded ``tokens`` of regenerated replies, ``max_length`` truncation /
skip) on the same conversations with ``extract.tokenize_workers`` = 1 (serial, in-process) and
= N (worker processes), checks that both give identical samples and counts, and prints
conversations/s, the ratio and JSON.

Conversations: the run config's prompt sources (``configs/smollm2-135m-full.yaml``:
ShareGPT multi-turn + first-turn chat, Alpaca, GSM8K from ``../shared/data/train``) mixed in
source order and cycled up to ``--num``; with ``--regenerated`` (default) every assistant reply is
replaced, as ``01 --regenerate`` does, by the decoded text of its first ``--max-new-tokens``
token ids and carries those ids as ``tokens``. ``--prompts FILE`` times a real 01 output instead.
The tokenizer load is timed separately (the GGUF load is slow and happens once per run).

    python bench/tokenize_throughput.py --config configs/smollm2-135m-full.yaml [--set verifier.path=DIR]
        [--num 4000] [--workers 1 16] [--json out.json]
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle3.cli import ArgumentParser, positive_int, run_main  # noqa: E402
from eagle3.config import add_config_args, load_config  # noqa: E402
from eagle3.io import atomic_write_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def build_conversations(
    cfg, tokenizer, num: int, regenerated: bool, max_new_tokens: int
) -> list[dict]:
    """``num`` prompt records ``{id, messages, line}`` from the config's prompt sources (cycled).

    With ``regenerated``, each assistant reply becomes ``decode(ids[:max_new_tokens])`` with
    ``tokens = ids[:max_new_tokens]`` (``ids`` = the reply tokenized), the shape 01 writes.
    """
    from eagle3.data.readers import read_conversations

    sources = cfg.prompts.source if isinstance(cfg.prompts.source, list) else [cfg.prompts.source]
    pool: list[dict] = []
    for src in sources:
        pool += read_conversations(src, cfg.prompts.format)
    if not pool:
        raise SystemExit("no conversations in the configured prompt sources")
    # interleave sources' order deterministically: a fixed stride walk over the pool
    out = []
    stride = 7919 % len(pool) or 1
    j = 0
    for i in range(num):
        conv = pool[j]
        j = (j + stride) % len(pool)
        msgs = []
        for m in conv["messages"]:
            m = {"role": m["role"], "content": m["content"]}
            if regenerated and m["role"] == "assistant":
                ids = tokenizer(m["content"], add_special_tokens=False)["input_ids"][
                    :max_new_tokens
                ]
                m = {
                    "role": "assistant",
                    "content": tokenizer.decode(ids, skip_special_tokens=True),
                    "tokens": [int(t) for t in ids],
                }
            msgs.append(m)
        out.append({"id": f"{conv['id']}#{i}", "messages": msgs, "line": i + 1})
    return out


def read_prompts_file(path: Path, num: int | None) -> list[dict]:
    from eagle3.capture.prompts import read_prompts

    return read_prompts(path, num)


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    add_config_args(p)
    p.add_argument(
        "--prompts",
        type=Path,
        default=None,
        help="a real prompts.jsonl (01 output) instead of the mix",
    )
    p.add_argument("--num", type=positive_int, default=4000, help="conversations")
    p.add_argument(
        "--no-regenerated",
        dest="regenerated",
        action="store_false",
        help="keep the dataset answers as plain text (no recorded token ids)",
    )
    p.add_argument(
        "--max-new-tokens",
        type=positive_int,
        default=256,
        help="reply length of the simulated regeneration",
    )
    p.add_argument(
        "--workers",
        type=positive_int,
        nargs="+",
        default=None,
        help="worker counts to time (default: 1 and the auto count for this machine)",
    )
    p.add_argument(
        "--repeats", type=positive_int, default=1, help="best of this many runs per worker count"
    )
    p.add_argument("--json", type=Path, default=None, help="also write the result here")
    a = p.parse_args(argv)
    cfg = load_config(a.config, a.overrides)

    from eagle3.capture.tokenize_pool import default_workers
    from eagle3.stages.extract import tokenize_prompts
    from eagle3.verifier.load import load_tokenizer

    t0 = time.perf_counter()
    tok = load_tokenizer(cfg.verifier)
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    if a.prompts is not None:
        prompts = read_prompts_file(a.prompts, a.num)
    else:
        prompts = build_conversations(cfg, tok, a.num, a.regenerated, a.max_new_tokens)
    build_s = time.perf_counter() - t0
    workers = a.workers or [1, default_workers()]

    runs = []
    ref = None
    for w in workers:
        c = cfg.model_copy(deep=True)
        c.extract.tokenize_workers = w
        best = None
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            samples, counts, _skipped = tokenize_prompts(tok, prompts, c, Path("<bench>"))
            dt = time.perf_counter() - t0
            best = dt if best is None else min(best, dt)
        got = ([(s.idx, s.id, s.input_ids, s.loss_mask) for s in samples], dict(counts))
        if ref is None:
            ref = got
        identical = got == ref
        runs.append(
            {
                "workers": w,
                "seconds": round(best, 3),
                "conv_per_s": round(len(prompts) / best, 1),
                "identical_to_first": identical,
            }
        )
        print(
            f"workers={w}: {len(prompts)} conversations in {best:.2f} s = {len(prompts) / best:.1f} conv/s"
            f"{'' if identical else '  MISMATCH vs the first run'}",
            flush=True,
        )
    n_tok = sum(len(s[2]) for s in ref[0])
    res = {
        "verifier": cfg.verifier.display_name(),
        "conversations": len(prompts),
        "source": str(a.prompts)
        if a.prompts
        else "config prompt sources" + (" (regenerated)" if a.regenerated else ""),
        "multi_turn": sum(
            1 for r in prompts if sum(m["role"] == "assistant" for m in r["messages"]) > 1
        ),
        "with_tokens": sum(1 for r in prompts if any("tokens" in m for m in r["messages"])),
        "samples": len(ref[0]),
        "tokens": n_tok,
        "counts": ref[1],
        "max_length": cfg.extract.max_length,
        "cpu_count": os.cpu_count(),
        "tokenizer_load_s": round(load_s, 2),
        "build_s": round(build_s, 2),
        "runs": runs,
        "tokenize_conv_per_s": runs[-1]["conv_per_s"],
        "ratio_vs_first": round(runs[0]["seconds"] / runs[-1]["seconds"], 2),
        "all_identical": all(r["identical_to_first"] for r in runs),
    }
    print("| workers | seconds | conversations/s | identical |")
    print("|---:|---:|---:|---|")
    for r in runs:
        print(
            f"| {r['workers']} | {r['seconds']} | {r['conv_per_s']} | {r['identical_to_first']} |"
        )
    print(f"ratio {workers[-1]} vs {workers[0]} workers: {res['ratio_vs_first']}x")
    print(json.dumps(res))
    if a.json:
        atomic_write_json(a.json, res)
    return 0 if res["all_identical"] else 1


if __name__ == "__main__":
    run_main(main)
