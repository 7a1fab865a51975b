"""Benchmark: fp8 shard storage vs bf16 on real verifier hidden states (issue 13 item 1).

Captures ``--samples`` real conversations with the configured verifier (default SmolLM2-135M-Instruct,
HF backend, on CPU: the multi-turn ShareGPT sample of ../shared/data, answers as given) -- or reads an
existing stage-02 shard folder with ``--shards`` -- and, for bf16 and each fp8 scale scheme, reports:

- bytes per token: of the format (``eagle3.shards.fp8.Storage.bytes_per_token``) and of the shard files
  actually written with ``eagle3.shards.format.write_sample`` (zip overhead included), both as a ratio to bf16;
- reconstruction relative RMS error per tensor ``||deq - h|| / ||h||`` (aux1, aux2, aux3, last),
  against the bf16 values that bf16 shards hold today;
- the error of the verifier targets, which come from the last hidden state (soft labels,
  ``p = softmax(lm_head(last))``, final norm first when the state is pre-norm): mean and max-row KL(p_bf16 || p_fp8)
  in nats, top-1 agreement, both over all positions and over loss-masked positions;
- quantise and dequantise speed on this CPU (tokens/s for 4 tensors).

Also the Kimi-K2.5 figures (H = 7168, 4 tensors): bytes per token and TB per million samples at the
issue's average length (17.3M tokens / 10K samples = 1730 tokens) and at the config's max_length
(4096); and item 5's figure: the fraction of positions whose last hidden state the loss reads
(``loss_mask[t+1] == 1``, DESIGN.md "TTT indexing"), i.e. what storing ``last`` only there would save.

    python bench/fp8_storage.py --json bench/results/fp8_storage_cpu.json
    python bench/fp8_storage.py --shards out/smollm2-135m-full/shards --samples 200  # a GPU run's shards

Runs in a few minutes on a 2-core CPU at the defaults (12 samples of up to 512 tokens).
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eagle3.io import atomic_write_json  # noqa: E402
from eagle3.shards.format import hidden_states_bf16, list_samples, load_sample, write_sample  # noqa: E402
from eagle3.shards.fp8 import Storage, dequantize, quantize  # noqa: E402

TENSORS = ("aux1", "aux2", "aux3", "last")
KIMI_H = 7168
KIMI_AVG_TOKENS = 17.3e6 / 10_000  # issue 13: 17.3M tokens in 10K samples
KIMI_MAX_LENGTH = 4096  # configs/kimi-k2.5.yaml extract.max_length
DEFAULT_SOURCE = ROOT.parent / "shared" / "data" / "train" / "sharegpt_v3_sample_multiturn.jsonl"


def capture_samples(config: str, n: int, max_length: int, source: Path):
    """``n`` real conversations through the verifier: list of (input_ids [L], loss_mask [L], 4 x bf16 [L, H]),
    plus the head (lm_head [V, H], norm weight or None, eps)."""
    from eagle3.capture.hf import HFCapture
    from eagle3.chat.samples import tokenize_conversation
    from eagle3.config import load_config
    from eagle3.data.readers import read_conversations
    from eagle3.engines.layers import default_aux_layers
    from eagle3.errors import UserError
    from eagle3.verifier.head import TargetHead
    from eagle3.verifier.load import load_verifier

    cfg = load_config(config)
    cfg.verifier.device = "cpu"
    cfg.verifier.dtype = "float32"
    t0 = time.perf_counter()
    model, tok = load_verifier(cfg.verifier)
    print(f"verifier loaded in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    n_layers = model.config.num_hidden_layers
    cap = HFCapture(model, default_aux_layers(n_layers), batch_tokens=4096)
    convs = read_conversations(str(source))
    out = []
    for conv in convs:
        if len(out) >= n:
            break
        try:
            res = tokenize_conversation(tok, conv["messages"], max_length)
        except (UserError, ValueError):
            continue  # a conversation the template cannot render as one sample: not needed here
        if res is None or len(res[0]) < 16:
            continue
        ids, mask = res
        hs = cap.capture([ids])[0]
        out.append((torch.tensor(ids), torch.tensor(mask), hs))
        print(f"captured {len(out)}/{n} ({len(ids)} tokens)", file=sys.stderr, flush=True)
    head = TargetHead.from_model(model, cap.last_hidden_state())
    norm = None if head.last_is_post_norm else head.norm_weight.float()
    return (
        out,
        head.lm_head.float(),
        norm,
        float(head.norm_eps),
        {"verifier": cfg.verifier.display_name(), "last_hidden_state": cap.last_hidden_state()},
    )


def read_shards(folder: Path, n: int, config: str | None):
    """The first ``n`` samples of a stage-02 folder (bf16 view) and the verifier head from ``config``."""
    samples = []
    for _idx, p in list_samples(folder)[:n]:
        s = load_sample(p)
        samples.append((s["input_ids"], s["loss_mask"], hidden_states_bf16(s)))
    if config is None:
        return samples, None, None, 0.0, {"shards": str(folder)}
    from eagle3.config import load_config
    from eagle3.shards.format import read_data_config
    from eagle3.verifier.head import TargetHead
    from eagle3.verifier.load import load_verifier

    cfg = load_config(config)
    cfg.verifier.device, cfg.verifier.dtype = "cpu", "float32"
    model, _ = load_verifier(cfg.verifier)
    meta = read_data_config(folder)
    head = TargetHead.from_model(model, meta["last_hidden_state"])
    norm = None if head.last_is_post_norm else head.norm_weight.float()
    return (
        samples,
        head.lm_head.float(),
        norm,
        float(head.norm_eps),
        {"shards": str(folder), "verifier": meta["verifier"]},
    )


def _logp(last: torch.Tensor, lm_head: torch.Tensor, norm, eps: float) -> torch.Tensor:
    x = last.float()  # [L, H]
    if norm is not None:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * norm
    return torch.log_softmax(x @ lm_head.T, dim=-1)  # [L, V]


def evaluate(samples, storage: Storage, lm_head, norm, eps: float, tmp: Path) -> dict:
    """Errors, bytes and speed of ``storage`` over ``samples`` (reference: the bf16 values)."""
    H = samples[0][2][0].shape[1]
    err_num = torch.zeros(4, dtype=torch.float64)
    err_den = torch.zeros(4, dtype=torch.float64)
    kl_sum = kl_mask_sum = 0.0
    kl_max = 0.0
    agree = agree_mask = n_pos = n_mask = 0
    tokens = 0
    q_s = dq_s = 0.0
    folder = tmp / storage.dtype / storage.scale / str(storage.block_size)
    for i, (ids, mask, hs) in enumerate(samples):
        L = ids.numel()
        tokens += L
        path = write_sample(folder, i, 1000, ids, hs, mask, storage)
        if storage.is_fp8:
            nb = storage.num_blocks(H)
            t0 = time.perf_counter()
            pairs = [quantize(h, nb) for h in hs]  # [L, H] fp8, [L, nb]
            t1 = time.perf_counter()
            deq = [dequantize(q, s, torch.bfloat16) for q, s in pairs]  # [L, H] bf16
            t2 = time.perf_counter()
            q_s += t1 - t0
            dq_s += t2 - t1
            stored = hidden_states_bf16(load_sample(path))
            assert all(torch.equal(a, b) for a, b in zip(stored, deq)), "shard round trip differs"
        else:
            deq = hs
        for k in range(4):
            ref = hs[k].double()
            err_num[k] += (deq[k].double() - ref).pow(2).sum()
            err_den[k] += ref.pow(2).sum()
        if lm_head is not None:
            lp_ref = _logp(hs[3], lm_head, norm, eps)  # [L, V]
            lp = _logp(deq[3], lm_head, norm, eps)  # [L, V]
            kl = (lp_ref.exp() * (lp_ref - lp)).sum(-1)  # [L]
            same = lp_ref.argmax(-1) == lp.argmax(-1)  # [L]
            # position t's distribution is a training target iff loss_mask[t+1] == 1 (DESIGN.md TTT indexing)
            used = torch.zeros(L, dtype=torch.bool)
            used[:-1] = mask[1:].bool()
            kl_sum += float(kl.sum())
            kl_max = max(kl_max, float(kl.max()))
            agree += int(same.sum())
            n_pos += L
            kl_mask_sum += float(kl[used].sum())
            agree_mask += int(same[used].sum())
            n_mask += int(used.sum())
    file_bytes = sum(p.stat().st_size for p in folder.rglob("data_*.pt"))
    row = {
        "storage": storage.dtype
        if not storage.is_fp8
        else f"fp8 {storage.scale}" + (f" {storage.block_size}" if storage.block_size else ""),
        "format_bytes_per_token": storage.bytes_per_token(H),
        "file_bytes_per_token": round(file_bytes / tokens, 1),
        "rel_rms": {
            name: float((err_num[k] / err_den[k]).sqrt()) for k, name in enumerate(TENSORS)
        },
    }
    if lm_head is not None:
        row.update(
            {
                "kl_mean": kl_sum / n_pos,
                "kl_max": kl_max,
                "top1_agree": agree / n_pos,
                "kl_mean_loss_pos": kl_mask_sum / max(1, n_mask),
                "top1_agree_loss_pos": agree_mask / max(1, n_mask),
            }
        )
    if storage.is_fp8:
        row["quantize_tok_per_s"] = round(tokens / q_s)
        row["dequantize_tok_per_s"] = round(tokens / dq_s)
    return row


def kimi_figures(schemes: list[Storage]) -> list[dict]:
    """Bytes per token and TB per million samples for Kimi-K2.5 (H = 7168) at the production lengths."""
    out = []
    base = Storage().bytes_per_token(KIMI_H)
    for st in schemes:
        try:
            b = st.bytes_per_token(KIMI_H)
        except ValueError:
            continue
        out.append(
            {
                "storage": "bfloat16"
                if not st.is_fp8
                else f"fp8 {st.scale}" + (f" {st.block_size}" if st.block_size else ""),
                "bytes_per_token": b,
                "ratio": round(b / base, 4),
                "tb_per_million_samples_avg_1730": round(b * KIMI_AVG_TOKENS * 1e6 / 1e12, 1),
                "tb_per_million_samples_max_4096": round(b * KIMI_MAX_LENGTH * 1e6 / 1e12, 1),
            }
        )
    return out


def markdown(rep: dict) -> str:
    has_kl = "kl_mean" in rep["rows"][0]
    lines = [
        f"fp8 shard storage on {rep['source']} ({rep['samples']} samples, {rep['tokens']} tokens, H = {rep['hidden_size']})",
        "",
        "| storage | bytes/token (format) | ratio | bytes/token (files) | ratio | rel RMS aux1 | aux2 | aux3 | last |"
        + (
            " KL mean (nats) | KL mean, loss pos | KL max | top-1 agree | top-1 agree, loss pos |"
            if has_kl
            else ""
        ),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|"
        + ("---:|---:|---:|---:|---:|" if has_kl else ""),
    ]
    b0, f0 = rep["rows"][0]["format_bytes_per_token"], rep["rows"][0]["file_bytes_per_token"]
    for r in rep["rows"]:
        e = r["rel_rms"]
        line = (
            f"| {r['storage']} | {r['format_bytes_per_token']} | {r['format_bytes_per_token'] / b0:.4f} | "
            f"{r['file_bytes_per_token']} | {r['file_bytes_per_token'] / f0:.4f} | "
            + " | ".join(f"{e[t]:.4f}" for t in TENSORS)
            + " |"
        )
        if has_kl:
            line += (
                f" {r['kl_mean']:.2e} | {r['kl_mean_loss_pos']:.2e} | {r['kl_max']:.2e} | {r['top1_agree']:.4f} | "
                f"{r['top1_agree_loss_pos']:.4f} |"
            )
        lines.append(line)
    lines += [
        "",
        "Kimi-K2.5 (H = 7168, 4 tensors per token):",
        "",
        "| storage | bytes/token | ratio | TB per 1M samples (avg 1730 tok) | TB per 1M samples (max_length 4096) |",
        "|---|---:|---:|---:|---:|",
    ]
    for k in rep["kimi"]:
        lines.append(
            f"| {k['storage']} | {k['bytes_per_token']} | {k['ratio']} | {k['tb_per_million_samples_avg_1730']} | "
            f"{k['tb_per_million_samples_max_4096']} |"
        )
    u = rep["last_state_used_fraction"]
    lines += [
        "",
        f"Item 5: the loss reads the last hidden state at {u:.1%} of positions (loss_mask[t+1] == 1); storing it "
        f"only there would save {(1 - u) / 4:.1%} of the hidden-state bytes (1 of 4 tensors).",
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--config",
        default=str(ROOT / "configs" / "smollm2-135m.yaml"),
        help="verifier (and lm_head) source",
    )
    p.add_argument("--shards", help="measure an existing stage-02 folder instead of capturing")
    p.add_argument(
        "--source", default=str(DEFAULT_SOURCE), help="conversations to capture (01-style file)"
    )
    p.add_argument("--samples", type=int, default=12)
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument(
        "--blocks", default="32,64,192", help="per_block block sizes to measure (must divide H)"
    )
    p.add_argument("--json", help="write the report as JSON here")
    a = p.parse_args(argv)
    torch.manual_seed(0)
    if a.shards:
        samples, lm_head, norm, eps, src = read_shards(Path(a.shards), a.samples, a.config)
    else:
        samples, lm_head, norm, eps, src = capture_samples(
            a.config, a.samples, a.max_length, Path(a.source)
        )
    H = samples[0][2][0].shape[1]
    schemes = [Storage(), Storage("float8_e4m3fn", "per_token")]
    schemes += [
        Storage("float8_e4m3fn", "per_block", int(b))
        for b in a.blocks.split(",")
        if b and H % int(b) == 0
    ]
    with tempfile.TemporaryDirectory() as tmp:
        rows = []
        for st in schemes:
            rows.append(evaluate(samples, st, lm_head, norm, eps, Path(tmp)))
            print(f"evaluated {rows[-1]['storage']}", file=sys.stderr, flush=True)
    tokens = sum(s[0].numel() for s in samples)
    used = sum(int(s[1][1:].sum()) for s in samples)
    kimi = [
        Storage(),
        Storage("float8_e4m3fn", "per_token"),
        Storage("float8_e4m3fn", "per_block", 128),
    ]
    rep = {
        "source": src.get("shards") or f"{src.get('verifier')} on {Path(a.source).name}",
        **src,
        "samples": len(samples),
        "tokens": tokens,
        "hidden_size": H,
        "rows": rows,
        "kimi": kimi_figures(kimi),
        "last_state_used_fraction": used / tokens,
        "loss_token_fraction": sum(int(s[1].sum()) for s in samples) / tokens,
    }
    print(markdown(rep))
    if a.json:
        atomic_write_json(a.json, rep)
    return 0 if all(math.isfinite(r["rel_rms"]["last"]) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
