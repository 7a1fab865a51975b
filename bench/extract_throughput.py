"""Benchmark: HF capture backend throughput vs the verifier's bare forward on the same batch.

Three timings on one ``[batch, seq]`` batch of random token ids (median of ``--repeats`` after
one warm-up):

- ``bare``: ``model(input_ids, attention_mask, use_cache=False, logits_to_keep=1)`` (the same
  model work the capture does, without hidden-state outputs or copies);
- ``bare_full_logits``: the plain forward with logits for every position;
- ``capture``: ``HFCapture.capture`` (``output_hidden_states=True``, 4 states -> bf16 CPU,
  per-sample slicing), i.e. stage 02's per-batch cost minus the disk write.

Prints a Markdown table and JSON; ``overhead`` = capture time / bare time.

    python bench/extract_throughput.py --config configs/smollm2-135m.yaml --device cpu --batch 4 --seq 512
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle3.capture.hf import HFCapture  # noqa: E402
from eagle3.cli import ArgumentParser, positive_int, run_main  # noqa: E402
from eagle3.config import add_config_args, load_config  # noqa: E402
from eagle3.io import atomic_write_json  # noqa: E402
from eagle3.layers import default_aux_layers  # noqa: E402
from eagle3.verifier import load_verifier, verifier_dims  # noqa: E402


def _timed(fns: dict, device: torch.device, repeats: int) -> dict:
    """Median seconds of each callable; one warm-up each, then the callables interleaved per repeat
    (so a load change on a shared machine hits all of them alike)."""
    for fn in fns.values():
        fn()
    times: dict = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    add_config_args(p)
    p.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: verifier.device)")
    p.add_argument("--batch", type=positive_int, default=4)
    p.add_argument("--seq", type=positive_int, default=512)
    p.add_argument("--repeats", type=positive_int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="also write the result here")
    a = p.parse_args(argv)
    cfg = load_config(a.config, a.overrides)

    t0 = time.perf_counter()
    model, _tok = load_verifier(cfg.verifier, device=a.device)
    load_s = time.perf_counter() - t0
    dims = verifier_dims(model.config)
    aux = cfg.extract.aux_layers or default_aux_layers(dims["num_layers"])
    device = model.get_input_embeddings().weight.device
    g = torch.Generator().manual_seed(a.seed)
    ids = torch.randint(0, dims["vocab_size"], (a.batch, a.seq), generator=g)  # [B, L]
    ids_dev = ids.to(device)
    att = torch.ones_like(ids_dev)  # [B, L]
    cap = HFCapture(model, aux, batch_tokens=a.batch * a.seq)
    batch = ids.tolist()

    @torch.inference_mode()
    def bare():
        model(input_ids=ids_dev, attention_mask=att, use_cache=False, logits_to_keep=1)

    @torch.inference_mode()
    def bare_full():
        model(input_ids=ids_dev, attention_mask=att, use_cache=False)

    t = _timed({"bare": bare, "full": bare_full, "capture": lambda: cap.capture(batch)}, device, a.repeats)
    t_bare, t_full, t_cap = t["bare"], t["full"], t["capture"]
    n = a.batch * a.seq
    res = {
        "verifier": cfg.verifier.display_name(),
        "device": str(device),
        "dtype": cfg.verifier.dtype,
        "torch_threads": torch.get_num_threads(),
        "batch": a.batch,
        "seq": a.seq,
        "aux_layers": list(aux),
        "load_s": round(load_s, 2),
        "bare_tokens_per_s": round(n / t_bare, 1),
        "bare_full_logits_tokens_per_s": round(n / t_full, 1),
        "capture_tokens_per_s": round(n / t_cap, 1),
        "overhead": round(t_cap / t_bare, 3),
        "bytes_per_token": 4 * dims["hidden_size"] * 2,
    }
    print("| verifier | device | batch x seq | bare tok/s | bare (all logits) tok/s | capture tok/s | overhead |")
    print("|---|---|---|---:|---:|---:|---:|")
    print(f"| {res['verifier']} | {res['device']} {res['dtype']} | {a.batch} x {a.seq} | {res['bare_tokens_per_s']} | "
          f"{res['bare_full_logits_tokens_per_s']} | {res['capture_tokens_per_s']} | {res['overhead']}x |")
    print(json.dumps(res))
    if a.json:
        atomic_write_json(a.json, res)
    return 0


if __name__ == "__main__":
    run_main(main)
