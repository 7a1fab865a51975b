"""Stage 03's outputs: ``token_freq.pt``, ``vocab_map.pt``, ``split.json``, ``data_report.json`` / ``.md``,
``coverage.png`` and the folder's manifest (:class:`eagle3.manifest.DataManifest`), written as one set."""

from __future__ import annotations

import io
import json

import torch

from eagle3 import manifest
from eagle3.data.vocab import TOKEN_FREQ, VOCAB_MAP, vocab_map_record
from eagle3.io import atomic_write_files

REPORT_JSON = "data_report.json"
SPLIT = "split.json"
REPORT_MD = "data_report.md"
PLOT = "coverage.png"


def _coverage_png(freq: torch.Tensor, draft_v: int, cov: float) -> bytes:
    """``coverage.png``: the coverage of loss-masked tokens by the top-k target ids against k, ``draft_v`` marked."""
    import matplotlib  # optional heavy dependency

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sorted_freq = torch.sort(freq, descending=True).values.double()  # [V]
    curve = torch.cumsum(sorted_freq, 0) / sorted_freq.sum()  # [V]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(range(1, len(curve) + 1), curve.numpy())
    ax.axvline(draft_v, color="r", ls="--", label=f"draft vocab {draft_v}: {cov:.2%}")
    ax.set_xscale("log")
    ax.set_xlabel("draft vocab size (most frequent target ids)")
    ax.set_ylabel("coverage of loss-masked tokens")
    ax.legend(loc="lower right")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()


def _torch_bytes(obj) -> bytes:
    """``torch.save(obj)``'s bytes (what :func:`eagle3.io.atomic_torch_save` writes)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def write_outputs(
    out,
    freq: torch.Tensor,
    d2t: torch.Tensor,
    t2d: torch.Tensor,
    split: dict,
    report: dict,
    made: manifest.DataManifest,
    cov: float,
    plot: bool,
) -> None:
    """03's outputs and their manifest ``made`` in ``out`` as one set (:func:`eagle3.io.atomic_write_files`): a
    failure replaces none of them, so the manifest 04 checks always describes the files beside it. Without ``plot``
    an earlier ``coverage.png`` is removed."""
    files = [
        (out / TOKEN_FREQ, _torch_bytes(freq)),
        (out / VOCAB_MAP, _torch_bytes(vocab_map_record(d2t, t2d, str(out / VOCAB_MAP)))),
        (out / SPLIT, (json.dumps(split, indent=2, ensure_ascii=False) + "\n").encode("utf-8")),
        (
            out / REPORT_JSON,
            (json.dumps(report, indent=2, ensure_ascii=False) + "\n").encode("utf-8"),
        ),
        (out / REPORT_MD, markdown(report).encode("utf-8")),
        (out / manifest.FILE, manifest.encode(made)),
    ]
    if plot:
        files.append((out / PLOT, _coverage_png(freq, int(d2t.numel()), cov)))
    atomic_write_files(files, remove=() if plot else (out / PLOT,))


def markdown(r: dict) -> str:
    rows = [
        ("verifier", r["verifier"]),
        (
            "samples (train / val)",
            f"{r['num_samples']} ({r['train_samples']} / {r['val_samples']})",
        ),
        ("tokens", r["num_tokens"]),
        ("loss-masked tokens", r["num_loss_tokens"]),
        ("target vocab", r["target_vocab_size"]),
        ("draft vocab", r["draft_vocab_size"]),
        ("coverage of loss tokens by draft vocab", f"{r['coverage']:.4%}"),
        ("distinct loss-token ids", r["distinct_loss_tokens"]),
        ("mean / max sample length", f"{r['mean_sample_len']} / {r['max_sample_len']}"),
        ("aux layers (HF index)", r["aux_layers"]),
        ("last hidden state", r["last_hidden_state"]),
        ("shard validation", r["validation"]),
    ]
    lines = ["# Stage 03: data report", "", "| item | value |", "|---|---:|"]
    lines += [f"| {k} | {v} |" for k, v in rows]
    return "\n".join(lines) + "\n"
