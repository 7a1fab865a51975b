"""Stage 02: tokenize the prompts file, capture verifier hidden states, write speculators shards.

Flow: read ``cfg.prompts_path`` (01 output) -> :func:`eagle3.chat.tokenize_conversation` (loss
mask, ``max_length``, ``too_long``) -> dense sample ids ``idx = 0..n-1`` over the kept
conversations in file order -> capture backend (``eagle3.capture``) in length-bucketed batches
(:func:`eagle3.capture.hf.plan_batches`) -> one shard per sample (``eagle3.shards``) ->
``data_config.json`` written LAST (its presence marks a complete extraction).

Crash safety (every kill point is recoverable by re-running the same command):

- each shard is written atomically (temp name + fsync + rename), so a shard file that exists is
  complete; a kill leaves at most ignorable ``*.tmp-*`` files, removed on the next run;
- after each shard lands, ``manifest.jsonl`` gets ``{idx, id, num_tokens, num_loss_tokens}``
  (flush + fsync). On re-run, an idx is finished when its manifest row and its shard both exist;
  a shard without a row (kill between rename and append) is validated, checked against the
  expected token ids and adopted; a row without a shard (shard deleted) is redone; a torn last
  manifest line is dropped and the manifest rewritten atomically. Finished shards are never
  rewritten;
- the batch plan is computed over ALL samples (not just the pending ones) and a batch with any
  pending sample is captured whole, so a resumed run feeds the verifier exactly the same padded
  batches as an uninterrupted one and produces bit-identical tensors;
- ``extract_state.json`` holds a fingerprint (sha256 of the verifier section minus ``device``,
  the extract fields that change the tensors, the prompts file sha256 and the verifier id),
  written at start. A different fingerprint on re-run is refused unless ``overwrite`` (which
  deletes this stage's files from the shards folder and starts over). ``batch_tokens`` is
  deliberately not part of it, so a run that ran out of memory can resume with a smaller budget
  (the resumed part then differs from an uninterrupted run only by float rounding).

Testing hook: the environment variable ``EAGLE3_EXTRACT_SLEEP_PER_BATCH`` (seconds, float)
makes the loop sleep after each captured batch, so a fault-injection test can SIGKILL a run on a
tiny verifier mid-way. It has no other effect.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from tqdm import tqdm

from eagle3.capture.base import CaptureBackend, check_captured
from eagle3.capture.hf import plan_batches
from eagle3.config import RunConfig
from eagle3.errors import UserError
from eagle3.io import TMP_MARK, atomic_write_json, atomic_write_text, read_json
from eagle3.layers import check_aux_layers, default_aux_layers
from eagle3.manifest import MANIFEST, ManifestWriter, read_manifest, rewrite_manifest
from eagle3.shards import (
    DATA_CONFIG,
    FORMAT,
    LAYER_INDEX_CONVENTION,
    bytes_per_token,
    list_samples,
    load_sample,
    remove_stale_tmp,
    shard_path,
    write_data_config,
    write_sample,
)

log = logging.getLogger(__name__)

STATE = "extract_state.json"
LOCK = ".extract.lock"
REPORT_JSON = "extract_report.json"
REPORT_MD = "extract_report.md"
SLEEP_ENV = "EAGLE3_EXTRACT_SLEEP_PER_BATCH"
_ROLES = ("system", "user", "assistant")


@dataclass
class Sample:
    """One tokenized conversation: dense shard ``idx``, prompt ``id``, ids and mask (``list[int]``)."""

    idx: int
    id: str
    input_ids: list[int]
    loss_mask: list[int]


# ---------------------------------------------------------------------------------------------
# prompts + tokenization
# ---------------------------------------------------------------------------------------------
def read_prompts(path: str | os.PathLike, limit: Optional[int] = None) -> list[dict]:
    """Read the 01 prompts file (JSONL ``{"id": str, "messages": [{"role", "content"}]}``).

    Args:
        limit: keep only the first ``limit`` records.

    Raises:
        UserError: missing file, malformed JSON, missing/mistyped key or role (``file:line: ...``).
    """
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: prompts file not found (run 01_prepare_prompts.py first)")
    out: list[dict] = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{path}:{n}: malformed JSON: {e.msg}") from e
            if not isinstance(rec, dict):
                raise UserError(f"{path}:{n}: expected a JSON object")
            if not isinstance(rec.get("id"), str):
                raise UserError(f"{path}:{n}: key 'id' missing or not a string")
            msgs = rec.get("messages")
            if not isinstance(msgs, list) or not msgs:
                raise UserError(f"{path}:{n}: key 'messages' missing or not a non-empty list")
            for k, m in enumerate(msgs):
                if not isinstance(m, dict) or m.get("role") not in _ROLES or not isinstance(m.get("content"), str):
                    raise UserError(f"{path}:{n}: key 'messages[{k}]' must be {{role: system|user|assistant, content: str}}")
            out.append({"id": rec["id"], "messages": msgs, "line": n})
    return out


def tokenize_prompts(tokenizer, prompts: list[dict], cfg: RunConfig, prompts_path: Path) -> tuple[list[Sample], Counter]:
    """Tokenize every conversation with :func:`eagle3.chat.tokenize_conversation`.

    Returns:
        ``(samples, counts)``: kept samples with dense idx in file order; counts
        ``skipped_too_long`` (``too_long: skip``), ``skipped_no_loss_tokens`` (no assistant
        token left), ``truncated`` (``too_long: truncate`` and the rendering was longer).

    Raises:
        UserError: the chat template fails on a conversation (message prefixed with file:line).
    """
    from eagle3.chat import tokenize_conversation

    ex = cfg.extract
    tpl = cfg.verifier.chat_template
    samples: list[Sample] = []
    counts: Counter = Counter()
    for rec in tqdm(prompts, desc="tokenize", unit="conv", mininterval=2.0):
        try:
            # Ask for one token more than allowed: tells "fits" from "was truncated" in one call.
            res = tokenize_conversation(tokenizer, rec["messages"], ex.max_length + 1, tpl, too_long="truncate")
        except UserError as e:
            raise UserError(f"{prompts_path}:{rec['line']}: {e}") from e
        if res is not None and len(res[0]) > ex.max_length:
            if ex.too_long == "skip":
                counts["skipped_too_long"] += 1
                continue
            counts["truncated"] += 1
            res = (res[0][: ex.max_length], res[1][: ex.max_length])
            if not any(res[1]):
                res = None
        if res is None:
            counts["skipped_no_loss_tokens"] += 1
            continue
        samples.append(Sample(len(samples), rec["id"], list(res[0]), list(res[1])))
    return samples, counts


# ---------------------------------------------------------------------------------------------
# fingerprint and folder state
# ---------------------------------------------------------------------------------------------
def file_sha256(path: str | os.PathLike) -> str:
    """Hex sha256 of a file's bytes (streamed)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fingerprint(cfg: RunConfig, prompts_sha256: str) -> tuple[str, dict]:
    """sha256 over what determines the shard tensors: returns ``(hex, components)``.

    Components: ``verifier`` section without ``device``; ``extract.{backend, aux_layers,
    max_length, too_long, rows_per_dir}``; the prompts file sha256; the verifier id.
    """
    comp = {
        "verifier": cfg.verifier.model_dump(exclude={"device"}),
        "extract": cfg.extract.model_dump(include={"backend", "aux_layers", "max_length", "too_long", "rows_per_dir"}),
        "prompts_sha256": prompts_sha256,
        "verifier_id": cfg.verifier.display_name(),
    }
    blob = json.dumps(comp, sort_keys=True, separators=(",", ":")).encode("utf-8")
    return hashlib.sha256(blob).hexdigest(), comp


def _is_stage_file(p: Path) -> bool:
    name = p.name
    return (
        name in (MANIFEST, DATA_CONFIG, STATE, REPORT_JSON, REPORT_MD)
        or TMP_MARK in name
        or (name.startswith("data_") and name.endswith(".pt"))
    )


def wipe_shards_dir(root: Path) -> int:
    """Delete this stage's files (shards, ``rows_*`` folders, manifest, state, reports) under ``root``.

    Other files are left alone (``root`` is user-configurable; never ``rmtree`` it blindly).
    Returns the number of files removed.
    """
    n = 0
    if not root.is_dir():
        return 0
    for entry in list(root.iterdir()):
        if entry.is_dir() and entry.name.startswith("rows_"):
            for f in list(entry.iterdir()):
                if f.is_file() and _is_stage_file(f):
                    f.unlink()
                    n += 1
            try:
                entry.rmdir()
            except OSError:
                pass  # the user put something else there: keep it
        elif entry.is_file() and _is_stage_file(entry):
            entry.unlink()
            n += 1
    return n


def _check_state(root: Path, fp: str, comp: dict, overwrite: bool) -> None:
    state_path = root / STATE
    has_data = root.is_dir() and any(True for _ in _iter_stage_files(root))
    if overwrite:
        n = wipe_shards_dir(root)
        if n:
            log.info("--overwrite: removed %d files from %s", n, root)
    elif state_path.is_file() and has_data:
        old = read_json(state_path)
        if not isinstance(old, dict) or old.get("fingerprint") != fp:
            old_comp = old.get("components", {}) if isinstance(old, dict) else {}
            diff = sorted(k for k in comp if old_comp.get(k) != comp[k]) or ["fingerprint"]
            raise UserError(
                f"{state_path}: key 'fingerprint': the shards in {root} were extracted with a different "
                f"{', '.join(diff)}; re-run with --overwrite to delete them and start over"
            )
    elif has_data:
        raise UserError(
            f"{root}: holds shards but no {STATE} (unknown provenance); re-run with --overwrite to delete them"
        )
    atomic_write_json(state_path, {"fingerprint": fp, "components": comp, "started_at": time.time()})


def _iter_stage_files(root: Path):
    for entry in root.iterdir():
        if entry.name == STATE:
            continue
        if (entry.is_dir() and entry.name.startswith("rows_")) or (entry.is_file() and _is_stage_file(entry)):
            yield entry


def _resume_state(root: Path, samples: list[Sample], rows_per_dir: int, expect: dict,
                  writer_path: Path) -> dict[int, dict]:
    """Finished idx -> manifest row, after reconciling ``manifest.jsonl`` with the shard files."""
    man = read_manifest(writer_path)
    on_disk = {idx: p for idx, p in list_samples(root)} if root.is_dir() else {}
    by_idx = {s.idx: s for s in samples}
    done: dict[int, dict] = {}
    changed = man.dropped_tail
    for idx, row in man.rows.items():
        if idx in on_disk:
            s = by_idx.get(idx)
            if s is not None and row["id"] != s.id:
                raise UserError(f"{writer_path}: sample {idx} is recorded as prompt '{row['id']}' but the prompts "
                                f"file gives '{s.id}'; re-run with --overwrite")
            done[idx] = row
        else:
            changed = True  # shard deleted: redo it
    adopt = sorted(set(on_disk) - set(done))
    for idx in adopt:
        s = by_idx.get(idx)
        if s is None:
            continue  # a shard outside this run's samples (e.g. an earlier run without --limit): keep
        try:
            got = load_sample(on_disk[idx], expect=expect)
            ok = got["input_ids"].tolist() == s.input_ids and got["loss_mask"].tolist() == s.loss_mask
        except UserError:
            ok = False
        if ok:
            done[idx] = {"idx": idx, "id": s.id, "num_tokens": len(s.input_ids), "num_loss_tokens": sum(s.loss_mask)}
            changed = True
        else:
            log.warning("%s: does not match its prompt; rewriting it", on_disk[idx])
            on_disk[idx].unlink()
    if changed:
        rewrite_manifest(writer_path, done)
    # The shard path depends on rows_per_dir; a row whose file is elsewhere is a foreign layout.
    for idx in done:
        if idx in by_idx and on_disk[idx] != shard_path(root, idx, rows_per_dir):
            raise UserError(f"{on_disk[idx]}: sample {idx} is not at {shard_path(root, idx, rows_per_dir)}; "
                            "re-run with --overwrite")
    return done


# ---------------------------------------------------------------------------------------------
# backends
# ---------------------------------------------------------------------------------------------
def make_backend(cfg: RunConfig, aux_layers: Optional[list[int]] = None):
    """Build the capture backend named by ``cfg.extract.backend`` and return ``(backend, tokenizer)``.

    ``hf``: loads the verifier in-process (``eagle3.verifier.load_verifier``). ``sglang``: the
    tokenizer only, plus ``eagle3.capture.sglang.SGLangCapture`` talking to
    ``cfg.extract.sglang_url`` (imported lazily). ``aux_layers=None`` = EAGLE default.

    Raises:
        UserError: missing ``extract.sglang_url`` / ``extract.capture_dir``, or the SGLang backend
            is not available.
    """
    from eagle3.verifier import load_tokenizer, load_verifier, load_verifier_config, verifier_dims

    ex = cfg.extract
    if ex.backend == "hf":
        from eagle3.capture.hf import HFCapture

        model, tok = load_verifier(cfg.verifier)
        n = verifier_dims(model.config)["num_layers"]
        layers = _resolve_aux(ex.aux_layers if aux_layers is None else aux_layers, n)
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        return HFCapture(model, layers, batch_tokens=ex.batch_tokens, pad_id=pad), tok
    if not ex.sglang_url:
        raise UserError("extract.sglang_url: required for backend sglang (or pass --server URL)")
    if not ex.capture_dir:
        raise UserError("extract.capture_dir: required for backend sglang (where the patched server writes tensors)")
    try:
        from eagle3.capture.sglang import SGLangCapture
    except ImportError as e:
        raise UserError(f"extract.backend: the sglang capture backend is not available ({e})") from e
    tok = load_tokenizer(cfg.verifier)
    n = verifier_dims(load_verifier_config(cfg.verifier))["num_layers"]
    layers = _resolve_aux(ex.aux_layers if aux_layers is None else aux_layers, n)
    return SGLangCapture(url=ex.sglang_url, capture_dir=ex.capture_dir, aux_layers=layers, timeout=ex.sglang_timeout_s,
                         max_length=ex.max_length, max_requests=ex.requests_per_batch), tok


def _resolve_aux(layers: Optional[list[int]], num_layers: int) -> list[int]:
    if layers is None:
        return check_aux_layers(default_aux_layers(num_layers), num_layers,
                                field="extract.aux_layers (default [2, N//2, N-3])")
    return check_aux_layers(layers, num_layers, field="extract.aux_layers")


# ---------------------------------------------------------------------------------------------
# the stage
# ---------------------------------------------------------------------------------------------
def run(cfg: RunConfig, *, overwrite: bool = False, limit: Optional[int] = None,
        backend: Optional[CaptureBackend] = None, tokenizer=None) -> dict:
    """Run stage 02 (resumable). See the module docstring for the crash-safety design.

    Args:
        cfg: run config (``extract`` section, ``verifier``, ``prompts_path``, ``shards_dir``).
        overwrite: delete this stage's existing files in ``cfg.shards_dir`` and start over.
        limit: only the first ``limit`` prompts.
        backend, tokenizer: an already-built backend and tokenizer (tests, benchmarks); default
            :func:`make_backend`. Its ``aux_layers`` must be the configured/default ones.

    Returns:
        summary dict (also written as ``extract_report.json`` / ``.md``): samples, tokens,
        written/resumed counts, skipped counts, seconds, captured tokens/s.

    Raises:
        UserError: bad prompts file, fingerprint mismatch, unknown folder contents, bad aux layers.
    """
    root = cfg.shards_dir
    root.mkdir(parents=True, exist_ok=True)
    with _exclusive(root):
        return _extract(cfg, root, overwrite, limit, backend, tokenizer)


@contextlib.contextmanager
def _exclusive(root: Path):
    """Hold an exclusive ``flock`` on ``{root}/.extract.lock`` (released by the OS even on SIGKILL).

    Raises:
        UserError: another stage-02 process is writing to ``root``.
    """
    import fcntl

    f = open(root / LOCK, "a+")
    try:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as e:
            raise UserError(f"{root / LOCK}: another 02_extract_hidden run is writing to {root}") from e
        yield
    finally:
        f.close()


def _extract(cfg: RunConfig, root: Path, overwrite: bool, limit: Optional[int],
             backend: Optional[CaptureBackend], tokenizer) -> dict:
    t_start = time.perf_counter()
    prompts_path = cfg.prompts_path
    prompts = read_prompts(prompts_path, limit)
    prompts_sha = file_sha256(prompts_path)
    fp, comp = fingerprint(cfg, prompts_sha)
    _check_state(root, fp, comp, overwrite)
    stale = remove_stale_tmp(root)
    if stale:
        log.info("removed %d unfinished temporary files from an interrupted run", len(stale))

    if backend is None:
        backend, tokenizer = make_backend(cfg)
    elif tokenizer is None:
        raise ValueError("run(): pass the tokenizer together with the backend")
    info = backend.info()
    aux = _resolve_aux(list(backend.aux_layers), info["num_layers"])
    if cfg.extract.aux_layers is not None and aux != list(cfg.extract.aux_layers):
        raise ValueError(f"backend captures {aux} but extract.aux_layers is {cfg.extract.aux_layers}")

    samples, counts = tokenize_prompts(tokenizer, prompts, cfg, prompts_path)
    rows_per_dir = cfg.extract.rows_per_dir
    expect = {"hidden_size": info["hidden_size"], "num_hidden_states": 4, "vocab_size": info["vocab_size"]}
    man_path = root / MANIFEST
    done = _resume_state(root, samples, rows_per_dir, expect, man_path)
    pending = [s for s in samples if s.idx not in done]
    if pending:
        (root / DATA_CONFIG).unlink(missing_ok=True)  # present == complete
    n_resumed = len(samples) - len(pending)
    log.info("%d samples (%d already done), %d skipped", len(samples), n_resumed,
             counts["skipped_too_long"] + counts["skipped_no_loss_tokens"])

    sleep_s = float(os.environ.get(SLEEP_ENV, "0") or 0)
    plan = plan_batches([len(s.input_ids) for s in samples], cfg.extract.batch_tokens)
    total_tok = sum(len(s.input_ids) for s in samples)
    done_tok = sum(len(s.input_ids) for s in samples if s.idx in done)
    written = 0
    t_cap = time.perf_counter()
    with ManifestWriter(man_path) as man, tqdm(total=total_tok, initial=done_tok, unit="tok", unit_scale=True,
                                               desc="capture", mininterval=1.0) as bar:
        for group in plan:
            batch = [samples[i] for i in group]
            if all(s.idx in done for s in batch):
                continue
            # Capture the whole planned batch (even finished members) so padded shapes match an
            # uninterrupted run exactly; only unfinished samples are written.
            states = backend.capture([s.input_ids for s in batch])
            if sleep_s:
                time.sleep(sleep_s)
            for s, st in zip(batch, states):
                if s.idx in done:
                    continue
                check_captured(s.input_ids, st, info["hidden_size"], f"sample {s.idx} ('{s.id}')")
                write_sample(root, s.idx, rows_per_dir, s.input_ids, st, s.loss_mask)
                done[s.idx] = man.append(s.idx, s.id, len(s.input_ids), num_loss_tokens=sum(s.loss_mask))
                written += 1
                bar.update(len(s.input_ids))
    t_cap = time.perf_counter() - t_cap
    captured_tok = total_tok - done_tok

    rows = [done[k] for k in sorted(done)]
    num_tokens = sum(r["num_tokens"] for r in rows)
    num_loss = sum(int(r.get("num_loss_tokens", 0)) for r in rows)
    from eagle3.chat import chat_template_hash

    meta = {
        "format": FORMAT,
        "verifier": cfg.verifier.display_name(),
        "architecture": info["architecture"],
        "num_layers": info["num_layers"],
        "hidden_size": info["hidden_size"],
        "vocab_size": info["vocab_size"],
        "aux_layers": aux,
        "layer_index_convention": LAYER_INDEX_CONVENTION,
        "last_hidden_state": info["last_hidden_state"],
        "dtype": "bfloat16",
        "max_length": cfg.extract.max_length,
        "rows_per_dir": rows_per_dir,
        "chat_template_hash": chat_template_hash(tokenizer, cfg.verifier.chat_template),
        "config_fingerprint": fp,
        "prompts_sha256": prompts_sha,
        "prompts_file": str(prompts_path),
        "backend": cfg.extract.backend,
        **({"sglang_tp_size": cfg.extract.sglang_tp_size} if cfg.extract.backend == "sglang" else {}),
        "num_samples": len(rows),
        "num_tokens": num_tokens,
        "num_loss_tokens": num_loss,
        "bytes_per_token": bytes_per_token(info["hidden_size"]),
        "skipped": {k: int(v) for k, v in sorted(counts.items()) if k.startswith("skipped")},
        "truncated": int(counts["truncated"]),
    }
    write_data_config(root, meta)
    summary = {
        "shards_dir": str(root),
        "prompts": len(prompts),
        "samples": len(rows),
        "written": written,
        "resumed": n_resumed,
        "num_tokens": num_tokens,
        "num_loss_tokens": num_loss,
        "skipped": meta["skipped"],
        "truncated": meta["truncated"],
        "capture_s": round(t_cap, 3),
        "total_s": round(time.perf_counter() - t_start, 3),
        "captured_tokens_per_s": round(captured_tok / t_cap, 1) if t_cap > 0 and captured_tok else None,
        "disk_gb": round(num_tokens * meta["bytes_per_token"] / 1e9, 4),
    }
    atomic_write_json(root / REPORT_JSON, summary)
    atomic_write_text(root / REPORT_MD, _markdown(summary))
    return summary


def _markdown(s: dict) -> str:
    lines = ["# Stage 02: hidden-state extraction", "", "| metric | value |", "|---|---:|"]
    for k in ("prompts", "samples", "written", "resumed", "num_tokens", "num_loss_tokens", "truncated",
              "capture_s", "total_s", "captured_tokens_per_s", "disk_gb"):
        lines.append(f"| {k} | {s[k]} |")
    for k, v in s["skipped"].items():
        lines.append(f"| {k} | {v} |")
    return "\n".join(lines) + "\n"
