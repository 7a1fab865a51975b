"""Stage 02's records: ``data_config.json``'s content, per-rank throughput, ``extract_report.md`` and the summary lines 02 prints."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from eagle3.capture.disk_plan import DiskPlan
from eagle3.chat.template import chat_template_hash, end_of_turn_ids
from eagle3.io import format_bytes
from eagle3.shards.data_config import bytes_per_token, storage_meta, tokens_meta
from eagle3.shards.format import LAYER_INDEX_CONVENTION
from eagle3.shards.fp8 import storage_from_config


def rank_stats(rank: int, written: int, captured_tokens: int, capture_s: float) -> dict:
    """One rank's throughput: ``written`` samples and ``captured_tokens`` in ``capture_s`` seconds."""
    return {
        "rank": rank,
        "written": written,
        "captured_tokens": captured_tokens,
        "capture_s": round(capture_s, 3),
        "samples_per_s": round(written / capture_s, 2) if capture_s > 0 and written else None,
        "tokens_per_s": round(captured_tokens / capture_s, 1)
        if capture_s > 0 and captured_tokens
        else None,
    }


def rate_text(value) -> str:
    """A figure for the logs, ``extract_report.md`` and 02's summary lines: ``n/a`` where none was measured (a torchrun
    rank dealt no batch, a resume that captured nothing), which printed as ``None tok/s``."""
    return "n/a" if value is None else str(value)


#: the summary keys ``extract_report.md``'s table shows, in order
REPORT_KEYS = (
    "prompts samples split_conversations split_samples written resumed num_tokens num_loss_tokens truncated "
    "capture_s total_s captured_tokens_per_s disk_gb"
).split()


def markdown(s: dict) -> str:
    lines = ["# Stage 02: hidden-state extraction", "", "| metric | value |", "|---|---:|"]
    lines += [f"| {k} | {rate_text(s[k])} |" for k in REPORT_KEYS]
    for k, v in s["skipped"].items():
        lines.append(f"| {k} | {v} |")
    for reason, ids in s.get("skipped_ids", {}).items():
        lines.append(
            f"| skipped ({reason}) | {', '.join(ids[:20])}{' ...' if len(ids) > 20 else ''} |"
        )
    if s.get("disk_plan"):
        lines += ["", DiskPlan(**s["disk_plan"]).describe()]
    return "\n".join(lines) + "\n"


def summary_lines(s: dict) -> list[str]:
    """What 02 prints after a run that wrote or resumed (``s``: the run's summary, ``extract_report.json``): one line
    per torchrun rank and their total, the disk plan, each SGLang server, then the totals."""
    out = [
        f"rank {r['rank']}: {r['written']} samples in {r['capture_s']} s, "
        f"{rate_text(r['samples_per_s'])} samples/s, {rate_text(r['tokens_per_s'])} tok/s"
        for r in s.get("ranks", [])
    ]
    if "ranks" in s:
        out.append(
            f"total ({s['world_size']} ranks): {s['written']} samples in {s['capture_s']} s, "
            f"{rate_text(s['samples_per_s'])} samples/s"
        )
    if s.get("disk_plan"):
        dp = s["disk_plan"]
        out.append(
            f"disk plan: {dp['samples']} samples, {dp['tokens']} tokens -> {format_bytes(dp['bytes'])} estimated "
            f"({format_bytes(dp['free_bytes'])} were free on {dp['path']})"
        )
    for sv in s.get("servers", []):
        out.append(
            f"server {sv['url']}: {sv['batches']} batches, {sv['failed_attempts']} failed attempts, "
            f"out of rotation {sv['taken_out_of_rotation']} times"
        )
    out.append(
        f"{s['samples']} samples ({s['written']} written, {s['resumed']} resumed), {s['num_tokens']} tokens, "
        f"{rate_text(s['captured_tokens_per_s'])} tok/s -> {s['shards_dir']}"
    )
    return out


def data_config(
    verifier,
    extract,
    *,
    tokens_only: bool,
    info: dict,
    aux: list[int],
    tokenizer,
    fp: str,
    prompts_sha: str,
    prompts_path: Path,
    rows: list[dict],
    counts: Counter,
    skipped_ids: dict,
    weights: dict,
) -> dict:
    """``data_config.json``'s content: format and storage, the verifier, rendering settings, counts
    and skipped ids. ``info``: the backend's; ``aux``: captured layers; ``fp`` / ``prompts_sha``:
    fingerprint and prompts sha256; ``rows``: manifest rows in idx order; ``weights``:
    ``{"verifier_weights": ...}`` or ``{}``.
    """
    ex, tokens = extract, tokens_only
    storage = storage_from_config(ex)
    hf = ex.backend == "hf"
    return {
        **(tokens_meta() if tokens else storage_meta(storage)),  # format, dtype (+ fp8 scale keys)
        "verifier": verifier.display_name(),
        **{k: info[k] for k in ("architecture", "num_layers", "hidden_size", "vocab_size")},
        "aux_layers": aux,
        "layer_index_convention": LAYER_INDEX_CONVENTION,
        "last_hidden_state": info["last_hidden_state"],
        "max_length": ex.max_length,
        "rows_per_dir": ex.rows_per_dir,
        "chat_template_hash": chat_template_hash(tokenizer, verifier.chat_template),
        "config_fingerprint": fp,
        "prompts_sha256": prompts_sha,
        "prompts_file": str(prompts_path),
        "backend": ex.backend,
        **({"sglang_tp_size": ex.sglang_tp_size} if ex.backend == "sglang" else {}),
        "num_samples": len(rows),
        "num_tokens": sum(r["num_tokens"] for r in rows),
        "num_loss_tokens": sum(int(r.get("num_loss_tokens", 0)) for r in rows),
        "bytes_per_token": 0 if tokens else bytes_per_token(info["hidden_size"], storage=storage),
        "skipped": {k: int(v) for k, v in sorted(counts.items()) if k.startswith("skipped")},
        "truncated": int(counts["truncated"]),
        "chat_template_kwargs": dict(verifier.chat_template_kwargs),
        "loss_on_reasoning": ex.loss_on_reasoning,
        **({"verifier_dtype": verifier.dtype} if hf else {}),  # named in 03's NaN/Inf errors
        **weights,  # 03/04 refuse another model under the same verifier.name
        "stop_token_ids": sorted(end_of_turn_ids(tokenizer)),  # the loss mask's turn end
        "split": {
            "conversations": int(counts["split_conversations"]),
            "samples": int(counts["split_samples"]),
        },
        "skipped_ids": skipped_ids,
    }
