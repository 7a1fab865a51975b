"""Stage 02: tokenize the prompts file, capture verifier hidden states, write speculators shards.

Usage: ``python 02_extract_hidden.py --config run.yaml`` (one process), or spread over GPUs with
``torchrun --nproc_per_node N 02_extract_hidden.py --config run.yaml`` (HF backend only): each rank
loads its own verifier on ``cuda:LOCAL_RANK`` (CPU when the config says cpu / no GPU), captures the
batches ``todo[rank::N]`` of the SAME global batch plan (tensors bit-identical to one process) into
the same shard folder, and rank 0 merges the per-rank manifests and writes ``data_config.json``.

Flow: read ``cfg.prompts_path`` (01 output) -> :func:`eagle3.prompts.chat.conversation_samples` (loss
mask, ``max_length``, ``too_long``; one or several samples per conversation) -> dense sample ids
``idx = 0..n-1`` over the kept samples in file order -> capture backend (``eagle3.capture``) in length-bucketed batches
(:func:`eagle3.capture.hf.plan_batches`) -> one shard per sample (``eagle3.shards.format``) ->
``data_config.json`` written LAST (its presence marks a complete extraction).

Crash safety (every kill point is recoverable by re-running the same command):

- each shard is written atomically (temp name + fsync + rename), so a shard file that exists is
  complete; a kill leaves at most ignorable ``*.tmp-*`` files, removed on the next run;
- after each shard lands, ``manifest.jsonl`` (``manifest.rank{r}.jsonl`` under torchrun) gets ``{idx, id, num_tokens, num_loss_tokens}``
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

Pipelining (``extract.write_threads`` > 0, the default): the forward of batch k+1 is launched
before batch k's states are waited for (HF backend: one pinned device->host copy per batch on a
side stream), and shards are serialised, hashed and written by background threads
(:mod:`eagle3.capture.shard_writer`) while the GPU works. Manifest rows are still appended in batch order
and only after their shard is durable, so the rules above hold unchanged and the folder is
byte-identical to the serial loop's (``write_threads: 0``).

Multi-process (``WORLD_SIZE > 1``, torch.distributed over gloo, CPU-only control traffic): rank 0
alone holds the folder lock (so an independent run is still refused, the job's own ranks are not),
checks the fingerprint, removes temp files, merges leftover ``manifest.rank*.jsonl`` into
``manifest.jsonl`` and reconciles it with the shards; the resulting finished set is broadcast, so
every rank derives the same list ``todo`` of batches with a pending sample. Each rank appends to its
own ``manifest.rank{r}.jsonl``; after an all-gather (the barrier) rank 0 merges them and writes
``data_config.json`` last. A kill leaves rank manifests that the next start (any world size, one
process included) merges first, so the resumed shard set is the same as an uninterrupted run's.

Token-only samples (``train.hidden_states: online``): the same tokenization, masks, sample ids,
manifest, resume rules and disk plan, but each shard holds only ``input_ids`` and ``loss_mask``
(format ``eagle3-tokens-v1``, 16 bytes per token, :mod:`eagle3.shards.format`); no prefill runs. The backend
is still built, for its ``info()`` (dims, aux layers, the last-hidden-state convention, recorded in
``data_config.json`` for 04 to check against the verifier it runs): the HF backend loads the verifier
and runs its one probe forward; the SGLang backend asks its server(s).

Testing hook: the environment variable ``EAGLE3_EXTRACT_SLEEP_PER_BATCH`` (seconds, float)
makes the loop sleep after each captured batch, so a fault-injection test can SIGKILL a run on a
tiny verifier mid-way. It has no other effect.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import json
import logging
import os
import time
from collections import Counter
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Optional

from tqdm import tqdm

from eagle3.capture.base import CaptureBackend, check_captured
from eagle3.capture.hf import plan_batches
from eagle3.capture.multi import prefetching
from eagle3.capture.shard_writer import ShardWriter
from eagle3.config import RunConfig
from eagle3.errors import UserError
from eagle3.io import (
    TMP_MARK,
    atomic_write_json,
    atomic_write_text,
    make_dirs,
    read_json,
    remove_stale_tmp,
)
from eagle3.io.lock import exclusive_lock
from eagle3.io.read import file_sha256, iter_jsonl, relative_hint
from eagle3.layers import check_aux_layers, check_servable, default_aux_layers
from eagle3.shards import (
    format as shard_format,  # TOKEN_PROCESS_MIN read at call time (tests lower it)
)
from eagle3.shards.checksum import DEFAULT_ALGO, file_checksum
from eagle3.shards.format import (
    DATA_CONFIG,
    EXTRACT_LOCK,
    LAYER_INDEX_CONVENTION,
    TOKEN_BYTES_PER_TOKEN,
    NonFiniteStates,
    bytes_per_token,
    list_samples,
    load_sample,
    shard_object,
    shard_path,
    storage_meta,
    tokens_meta,
    write_data_config,
)
from eagle3.shards.fp8 import Storage, storage_from_config
from eagle3.shards.manifest import MANIFEST, ManifestWriter, read_manifest, rewrite_manifest

log = logging.getLogger(__name__)

STATE = "extract_state.json"
LOCK = EXTRACT_LOCK  # shards/.extract.lock (03 checks it: eagle3.data.prepare_data)
REPORT_JSON = "extract_report.json"
REPORT_MD = "extract_report.md"
SLEEP_ENV = "EAGLE3_EXTRACT_SLEEP_PER_BATCH"
RANK_MANIFEST_PREFIX = "manifest.rank"
DIST_TIMEOUT = timedelta(hours=6)  # ranks wait for the slowest one at the final gather
_ROLES = ("system", "user", "assistant", "tool")


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
    """Read the 01 prompts file (JSONL ``{"id": str, "messages": [...], "tools"?: [...]}``).

    A message is ``{role: system|user|assistant|tool, content: str}`` plus, optionally,
    ``reasoning_content: str``, ``tool_calls: list`` (assistant), ``tool_call_id``/``name`` (tool)
    ``tokens: [int]`` (assistant, the ids the verifier generated), ``truncated: bool`` (assistant, cut at
    ``prompts.max_new_tokens``: no loss on the template's end-of-turn token) and ``stop_token: int`` (assistant, the
    stop id the verifier ended it on: no loss on the template's end-of-turn token when that is another id); see
    DESIGN.md "Prompts file".

    Args:
        limit: keep only the first ``limit`` records.

    Raises:
        UserError: missing or empty file, malformed JSON, missing/mistyped key or role (``file:line: ...``).
    """
    path = Path(path)
    if not path.is_file():
        raise UserError(
            f"{path}: prompts file not found (run 01_prepare_prompts.py first"
            + (f"; {relative_hint(path)})" if relative_hint(path) else ")")
        )
    out: list[dict] = []
    for n, rec in iter_jsonl(path):
        if limit is not None and len(out) >= limit:
            break
        if not isinstance(rec, dict):
            raise UserError(f"{path}:{n}: expected a JSON object")
        if not isinstance(rec.get("id"), str):
            raise UserError(f"{path}:{n}: key 'id' missing or not a string")
        msgs = rec.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise UserError(f"{path}:{n}: key 'messages' missing or not a non-empty list")
        for k, m in enumerate(msgs):
            if (
                not isinstance(m, dict)
                or m.get("role") not in _ROLES
                or not isinstance(m.get("content"), str)
            ):
                raise UserError(
                    f"{path}:{n}: key 'messages[{k}]' must be {{role: {'|'.join(_ROLES)}, content: str}}"
                )
            for key, typ in (
                ("reasoning_content", str),
                ("tool_calls", list),
                ("tool_call_id", str),
                ("tokens", list),
                ("truncated", bool),
            ):
                if m.get(key) is not None and not isinstance(m[key], typ):
                    raise UserError(
                        f"{path}:{n}: key 'messages[{k}].{key}' must be a {typ.__name__}"
                    )
            _check_token_list(m.get("tokens"), f"{path}:{n}: key 'messages[{k}].tokens")
            if m.get("stop_token") is not None:
                _check_token_list([m["stop_token"]], f"{path}:{n}: key 'messages[{k}].stop_token")
        tools = rec.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise UserError(f"{path}:{n}: key 'tools' must be a list of tool declarations")
        out.append(
            {"id": rec["id"], "messages": msgs, "line": n, **({"tools": tools} if tools else {})}
        )
    if not out:
        raise UserError(
            f"{path}: no conversations in the prompts file (empty or blank lines only; re-run "
            "01_prepare_prompts.py)"
        )
    return out


def _check_token_list(tokens: Optional[list], where: str) -> None:
    """Refuse an answer's ``tokens`` item that is not a token id (an integer >= 0; ``true`` and ``1.5`` included,
    which ``int()`` took as 1), naming ``<where>[i]'`` (before: ``"x"`` was a ValueError traceback, ``-5`` an
    IndexError in the verifier's embedding)."""
    for i, t in enumerate(tokens or ()):
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            at = "'" if where.endswith(".stop_token") else f"[{i}]'"
            raise UserError(f"{where}{at} must be a token id (an integer >= 0), got {t!r}")


def check_token_ids(prompts: list[dict], vocab_size: int, path: Path) -> None:
    """Refuse a ``tokens`` id at or past the verifier's vocab (``prompts.jsonl`` made with another verifier, or edited
    by hand): one line naming the file, line and key, before anything is captured (before: an IndexError traceback
    from the embedding lookup, after the disk plan).

    Raises:
        UserError: ``<path>:<line>: key 'messages[k].tokens[i]' = 99999 is not a token id of this verifier ...``.
    """
    for rec in prompts:
        for k, m in enumerate(rec["messages"]):
            bad = next(
                (
                    (f"tokens[{i}]", t)
                    for i, t in enumerate(m.get("tokens") or ())
                    if t >= vocab_size
                ),
                None,
            )
            if bad is None and m.get("stop_token") is not None and m["stop_token"] >= vocab_size:
                bad = ("stop_token", m["stop_token"])
            if bad is not None:
                raise UserError(
                    f"{path}:{rec['line']}: key 'messages[{k}].{bad[0]}' = {bad[1]} is not a token "
                    f"id of this verifier (vocab {vocab_size}): were the answers generated by another one? "
                    "Re-run 01_prepare_prompts.py with this verifier"
                )


MAX_SKIPPED_IDS = 1000  # ids of skipped conversations kept per reason in data_config / the report


def _tokenize_one(tokenizer, rec: dict, *, max_length: int, opts, too_long: str, where: str):
    """The per-conversation step of :func:`tokenize_prompts` (module-level: runs in
    :mod:`eagle3.capture.tokenize_pool` workers): :func:`eagle3.prompts.chat.conversation_samples` of ``rec``; a
    template-wide error becomes ``UserError("{where}:{line}: ...")``."""
    from eagle3.prompts.chat import conversation_samples

    try:
        return conversation_samples(
            tokenizer, rec["messages"], max_length, opts, too_long, rec.get("tools")
        )
    except UserError as e:
        raise UserError(f"{where}:{rec['line']}: {e}") from e


def tokenize_prompts(
    tokenizer, prompts: list[dict], cfg: RunConfig, prompts_path: Path
) -> tuple[list[Sample], Counter, dict[str, list[str]]]:
    """Turn every conversation into training samples with :func:`eagle3.prompts.chat.conversation_samples`.

    A conversation gives one sample (id = its id) or, when the template's history changes as turns
    are added, several (ids ``{id}#turn{n}``); dense ``idx`` in file order over all samples. The
    conversations are spread over ``extract.tokenize_workers`` processes (:mod:`eagle3.capture.tokenize_pool`;
    results in file order, so nothing here depends on the worker count).

    Returns:
        ``(samples, counts, skipped_ids)``: counts ``skipped_too_long`` (``too_long: skip``),
        ``skipped_no_loss_tokens``, ``skipped_inconsistent`` / ``skipped_render_failed`` (whole
        conversations without a consistent rendering), ``truncated``, ``split_conversations``,
        ``split_samples``; ``skipped_ids``: reason -> conversation ids (first
        :data:`MAX_SKIPPED_IDS`).

    Raises:
        UserError: template-wide problems (no template, template ignores add_generation_prompt),
            or every conversation failed to render (message prefixed with the first one's file:line), or every
            one was skipped (too long with ``too_long: skip``, no loss token: no sample at all);
            the conversation named is the first in file order, whatever the worker count.
    """
    from eagle3.capture.tokenize_pool import map_records
    from eagle3.prompts.chat import ChatOptions

    ex = cfg.extract
    one = functools.partial(
        _tokenize_one,
        max_length=ex.max_length,
        opts=ChatOptions.from_config(cfg),
        too_long=ex.too_long,
        where=str(prompts_path),
    )
    samples: list[Sample] = []
    counts: Counter = Counter()
    skipped: dict[str, list[str]] = {}
    first_failure = None
    for rec, res in zip(
        prompts, map_records(one, tokenizer, prompts, workers=ex.tokenize_workers, desc="tokenize")
    ):
        counts.update(res.counts)
        if res.skip_reason is not None:
            ids = skipped.setdefault(
                res.skip_reason.split(":", 1)[0]
                if res.skip_reason.startswith("render_failed")
                else res.skip_reason,
                [],
            )
            if len(ids) < MAX_SKIPPED_IDS:
                ids.append(rec["id"])
            if first_failure is None:
                first_failure = f"{prompts_path}:{rec['line']}: conversation '{rec['id']}' skipped: {res.skip_reason}"
                log.warning("%s", first_failure)
        for s in res.samples:
            samples.append(
                Sample(len(samples), rec["id"] + s.suffix, list(s.input_ids), list(s.loss_mask))
            )
    if (
        not samples
        and first_failure is not None
        and counts["skipped_render_failed"] == len(prompts)
    ):
        raise UserError(f"every conversation failed to render; the first: {first_failure}")
    if (
        not samples and prompts
    ):  # too long (too_long: skip), no loss token, ...: an empty shard set that 02 called
        # done (exit 0) and 03 then refused ("no shards found")
        why = ", ".join(
            f"{k.removeprefix('skipped_').replace('_', ' ')}: {v}"
            for k, v in sorted(counts.items())
            if k.startswith("skipped_") and v
        )
        hints = [
            h
            for k, h in (
                ("skipped_too_long", "raise extract.max_length or set extract.too_long: truncate"),
                (
                    "skipped_no_loss_tokens",
                    "a conversation needs an assistant answer (01 with "
                    "prompts.regenerate: true writes them)",
                ),
            )
            if counts[k]
        ]
        raise UserError(
            f"{prompts_path}: no sample to capture: every conversation was skipped ({why}; the first at "
            f"line {prompts[0]['line']}, conversation '{prompts[0]['id']}'); "
            + "".join(h + "; " for h in hints)
            + "nothing written"
        )
    if counts["split_conversations"]:
        log.info(
            "%d conversations split into %d samples (history rendered differently per turn)",
            counts["split_conversations"],
            counts["split_samples"],
        )
    return samples, counts, skipped


# ---------------------------------------------------------------------------------------------
# fingerprint and folder state
# ---------------------------------------------------------------------------------------------
def token_only(cfg: RunConfig) -> bool:
    """Whether stage 02 writes token-only samples (``train.hidden_states: online``; :mod:`eagle3.shards.format`)."""
    return cfg.train.hidden_states == "online"


def fingerprint(cfg: RunConfig, prompts_sha256: str) -> tuple[str, dict]:
    """sha256 over what determines the shard tensors: returns ``(hex, components)``.

    Components: ``verifier`` section without ``device``; ``extract.{backend, aux_layers,
    max_length, too_long, rows_per_dir}``; the prompts file sha256; the verifier id; the fp8
    storage (``storage``, only when ``extract.storage_dtype`` is not bfloat16); ``samples: tokens``
    for token-only samples (so a folder of one kind never resumes as the other).
    """
    # Rendering fields added later are left out while at their defaults, so folders extracted
    # before they existed still resume.
    ver = cfg.verifier.model_dump(exclude={"device"}, mode="json")
    ext = cfg.extract.model_dump(
        include={
            "backend",
            "aux_layers",
            "max_length",
            "too_long",
            "rows_per_dir",
            "loss_on_reasoning",
        },
        mode="json",
    )
    for key, default in (
        ("chat_template_kwargs", {}),
        ("reply_start", None),
        ("think_tags", ["<think>", "</think>"]),
    ):
        if ver.get(key) == default:
            del ver[key]
    if ext.get("loss_on_reasoning") is True:
        del ext["loss_on_reasoning"]
    comp = {
        "verifier": ver,
        "extract": ext,
        "prompts_sha256": prompts_sha256,
        "verifier_id": cfg.verifier.display_name(),
    }
    storage = storage_from_config(cfg.extract)
    if token_only(cfg):
        comp["samples"] = "tokens"
    elif (
        storage.is_fp8
    ):  # only when set, so bf16 folders of earlier versions keep their fingerprint
        comp["storage"] = storage.to_meta()
    blob = json.dumps(comp, sort_keys=True, separators=(",", ":")).encode("utf-8")
    return hashlib.sha256(blob).hexdigest(), comp


def _is_stage_file(p: Path) -> bool:
    name = p.name
    return (
        name in (MANIFEST, DATA_CONFIG, STATE, REPORT_JSON, REPORT_MD)
        or _is_rank_manifest(name)
        or TMP_MARK in name
        or (name.startswith("data_") and name.endswith(".pt"))
    )


def rank_manifest_name(rank: int) -> str:
    """File name of rank ``rank``'s manifest under torchrun: ``manifest.rank{rank}.jsonl``."""
    return f"{RANK_MANIFEST_PREFIX}{int(rank)}.jsonl"


def _is_rank_manifest(name: str) -> bool:
    """True for ``manifest.rank{r}.jsonl`` names (``r`` a non-negative integer)."""
    mid = name[len(RANK_MANIFEST_PREFIX) : -len(".jsonl")]
    return name.startswith(RANK_MANIFEST_PREFIX) and name.endswith(".jsonl") and mid.isdigit()


def merge_rank_manifests(root: Path) -> int:
    """Fold every ``manifest.rank*.jsonl`` in ``root`` into ``manifest.jsonl`` and delete them.

    The union (last row per idx wins; rows for one idx are identical anyway) is written
    atomically before the rank files are removed, so a kill in between only repeats an idempotent
    merge on the next start. Torn last lines are dropped (their shards get adopted by the resume
    logic). Returns the number of rank files merged (0: nothing to do, ``manifest.jsonl`` untouched).

    Raises:
        UserError: a rank manifest is corrupt other than in its last line.
    """
    parts = (
        sorted(p for p in root.iterdir() if p.is_file() and _is_rank_manifest(p.name))
        if root.is_dir()
        else []
    )
    if not parts:
        return 0
    rows = dict(read_manifest(root / MANIFEST).rows)
    for p in parts:
        rows.update(read_manifest(p).rows)
    rewrite_manifest(root / MANIFEST, rows)
    for p in parts:
        p.unlink()
    return len(parts)


def _wipe_targets(root: Path) -> tuple[list[Path], list[Path]]:
    """``(files, rows_* folders)`` that :func:`wipe_shards_dir` deletes under ``root``."""
    files: list[Path] = []
    dirs: list[Path] = []
    if not root.is_dir():
        return files, dirs
    for entry in list(root.iterdir()):
        if entry.is_dir() and entry.name.startswith("rows_"):
            files += [f for f in entry.iterdir() if f.is_file() and _is_stage_file(f)]
            dirs.append(entry)
        elif entry.is_file() and _is_stage_file(entry):
            files.append(entry)
    return files, dirs


def wipe_frees_bytes(root: Path) -> int:
    """Bytes the filesystem gets back when :func:`wipe_shards_dir` runs on ``root`` (allocated blocks
    of the files it deletes, ``st_blocks x 512``): what ``--overwrite`` may count as free in the disk
    plan, which runs before anything is deleted."""
    files, _ = _wipe_targets(root)
    return sum(f.stat().st_blocks * 512 for f in files)


def wipe_shards_dir(root: Path) -> int:
    """Delete this stage's files (shards, ``rows_*`` folders, manifest, state, reports) under ``root``.

    Other files are left alone (``root`` is user-configurable; never ``rmtree`` it blindly).
    Returns the number of files removed.
    """
    files, dirs = _wipe_targets(root)
    for f in files:
        f.unlink()
    for entry in dirs:
        try:
            entry.rmdir()
        except OSError:
            pass  # the user put something else there: keep it
    return len(files)


def changed_settings(old: dict, new: dict) -> list[str]:
    """What differs between two :func:`fingerprint` component dicts, one entry per config key:
    ``extract.max_length: 2048 -> 4096``, ``verifier.dtype: 'bfloat16' -> 'float32'``, ``the prompts
    file (prompts.jsonl: sha256 1a2b3c4d -> 5e6f7a8b)``, ``train.hidden_states: 'offline' -> 'online'`` (token-only
    samples, component ``samples``). A key left out of one side (a rendering field at its
    default, see :func:`fingerprint`) shows as ``default``; an old state file without components gives []."""

    def flat(comp: dict) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in comp.items():
            if k in ("verifier", "extract") and isinstance(v, dict):
                out.update({f"{k}.{kk}": vv for kk, vv in v.items()})
            elif k == "storage" and isinstance(
                v, dict
            ):  # Storage.to_meta() names -> the extract config keys
                names = {
                    "storage_dtype": "storage_dtype",
                    "scale_scheme": "fp8_scale",
                    "scale_block_size": "fp8_block_size",
                }
                out.update(
                    {
                        f"extract.{names[kk]}": vv
                        for kk, vv in v.items()
                        if kk in names and vv is not None
                    }
                )
            else:
                out[k] = v
        return out

    if not old:
        return []
    a, b = flat(old), flat(new)
    if "storage" in new and "storage" not in old:
        a.setdefault("extract.storage_dtype", "bfloat16")
    if "storage" in old and "storage" not in new:
        b.setdefault("extract.storage_dtype", "bfloat16")
    for side in (
        a,
        b,
    ):  # token-only samples: the key the user set (it read "samples: default -> 'tokens'")
        side["train.hidden_states"] = (
            "online" if side.pop("samples", None) == "tokens" else "offline"
        )
    out = []
    for key in sorted(set(a) | set(b)):
        va, vb = a.get(key, "default"), b.get(key, "default")
        if va == vb:
            continue
        if key == "prompts_sha256":
            out.append(f"the prompts file (sha256 {str(va)[:8]} -> {str(vb)[:8]})")
        elif key == "verifier_id":
            out.append(f"the verifier id: {va!r} -> {vb!r}")
        else:
            fa = "default" if key not in a else _short_value(va)
            fb = "default" if key not in b else _short_value(vb)
            out.append(f"{key}: {fa} -> {fb}")
    return out


def _short_value(v: Any, limit: int = 60) -> str:
    """``repr`` of a setting on one line, cut to ``limit`` characters (chat templates are long)."""
    t = repr(v)
    return t if len(t) <= limit else t[: limit - 3] + "..."


def _check_state(root: Path, fp: str, comp: dict, overwrite: bool, weights: dict) -> None:
    """Refuse to resume into ``root`` under other settings, then record this run's in ``extract_state.json``.

    Args:
        fp, comp: :func:`fingerprint` of this run.
        weights: ``{"verifier_weights": ...}`` of the verifier (:func:`eagle3.verifier.weights_record`; ``{}``: none):
            recorded beside the fingerprint (outside its hash, so folders of before keep theirs) and compared with
            the one recorded there (the state's, else ``data_config.json``'s): weights replaced at the same
            ``verifier.path`` would mix two models' states in one set.

    Raises:
        UserError: ``<extract_state.json>: the shards in <root> were extracted with other settings: changed ...;
            re-run with --overwrite ..., or set extract.output_dir to another folder ...``, or shards without a
            state file.
    """
    state_path = root / STATE
    has_data = root.is_dir() and any(True for _ in _iter_stage_files(root))
    if overwrite:
        n = wipe_shards_dir(root)
        if n:
            log.info("--overwrite: removed %d files from %s", n, root)
    elif state_path.is_file() and has_data:
        old = read_json(state_path)
        changed = []
        if not isinstance(old, dict) or old.get("fingerprint") != fp:
            old_comp = old.get("components", {}) if isinstance(old, dict) else {}
            changed = changed_settings(old_comp, comp) or ["the settings fingerprint"]
        elif moved := _weights_changed(root, old, weights):
            changed = [f"the weights at verifier.path (verifier_weights: {moved})"]
        if changed:
            raise UserError(
                f"{state_path}: the shards in {root} were extracted with other settings: changed "
                f"{'; '.join(changed)}; re-run with --overwrite to delete them and start over, or set extract.output_dir "
                f"to another folder to keep them (another run may read them)"
            )
        unchecked = _weights_unchecked(root, old, weights)
        if unchecked:  # resumed with the weights not compared: said, not silent
            log.warning("%s", unchecked)
    elif has_data:
        raise UserError(
            f"{root}: holds shards but no {STATE} (unknown provenance); re-run with --overwrite to delete them, or set "
            "extract.output_dir to another folder to keep them"
        )
    atomic_write_json(
        state_path, {"fingerprint": fp, "components": comp, **weights, "started_at": time.time()}
    )


def _weights_changed(root: Path, state: dict, weights: dict) -> Optional[str]:
    """``'<recorded> -> <now>'`` when the verifier weights recorded for ``root`` (``extract_state.json``'s
    ``verifier_weights``, else ``data_config.json``'s) differ from ``weights`` (:func:`eagle3.verifier.weights_record`
    of this run); None when they agree or either side has none (nothing to compare, as 03/04 do)."""
    from eagle3.verifier import weights_differ

    now = weights.get("verifier_weights")
    was, _ = _recorded_weights(root, state)
    return f"{was} -> {now}" if weights_differ(was, now) else None


def _recorded_weights(root: Path, state: Any) -> tuple[Optional[str], Path]:
    """``(fingerprint, file)``: the verifier weights the shards folder ``root`` records, from ``state``
    (``extract_state.json``'s content) else from ``data_config.json`` (None when neither records one or the file does
    not read; ``file``: where it was read, ``extract_state.json`` when nowhere)."""
    was = state.get("verifier_weights") if isinstance(state, dict) else None
    if was is None and (root / DATA_CONFIG).is_file():
        try:
            meta = read_json(root / DATA_CONFIG)
        except UserError:
            meta = None
        was = meta.get("verifier_weights") if isinstance(meta, dict) else None
        if was is not None:
            return was, root / DATA_CONFIG
    return was, root / STATE


def _read_state(root: Path) -> Optional[dict]:
    """``extract_state.json`` of ``root``, or None when it does not read as a JSON object."""
    try:
        state = read_json(root / STATE)
    except UserError:
        return None
    return state if isinstance(state, dict) else None


def _weights_unchecked(root: Path, state: Any, weights: dict) -> Optional[str]:
    """The one warning line saying that the verifier weights of the shards in ``root`` were not compared with this
    run's (:func:`_weights_changed`) because only one side has a fingerprint: the folder's record (``state``:
    ``extract_state.json``, else ``data_config.json``) has none (shards of a 02 from before 2026-12-05f) or the
    folder at ``verifier.path`` holds no weight file here (``weights`` ``{}``); None when both or neither have one
    (neither: :func:`eagle3.shards.format.check_verifier` says so at 03/04). 02 resumed into such a folder, or found
    it up to date, without a word."""
    now = weights.get("verifier_weights")
    was, where = _recorded_weights(root, state)
    if bool(was) == bool(now):
        return None
    if not was:
        why = (
            f"{where}: records no verifier_weights (shards extracted by a 02 of before 2026-12-05f): 02 did not "
            f"check the weights at verifier.path against the model the shards in {root} were captured from"
        )
    else:
        why = (
            f"{where}: records verifier_weights {str(was)[:19]}... but verifier.path holds no weight file here: "
            f"02 did not check that it is the model the shards in {root} were captured from"
        )
    return (
        why
        + "; check that it is, or re-run with --overwrite to capture every shard from this one (a set from "
        "two models trains against one's lm_head)"
    )


def check_prompts_current(cfg: RunConfig) -> None:
    """Refuse a ``prompts.jsonl`` that 01 made under other ``prompts:`` settings than ``cfg``'s
    (:func:`eagle3.prompts.prepare_prompts.report_changes`; no ``prompts_report.json``: nothing to compare), or one
    that an unfinished ``01 --force`` was remaking (its marker :func:`eagle3.prompts.prepare_prompts.forced_path`).
    The report is read once, for the comparison and the refusal's hint.

    Raises:
        UserError: one line naming ``prompts_report.json`` (or the marker), the changed settings and the fix (re-run
            01).
    """
    from eagle3.prompts.prepare_prompts import forced_path, read_report, report_changes

    forced = forced_path(cfg)
    if (
        forced.is_file()
    ):  # its report still matches, but 01 was told to remake it and did not finish
        raise UserError(
            f"{forced}: a 01_prepare_prompts.py --force run did not finish, so {cfg.prompts_path} is the "
            f"one from before it; re-run 01 (the same command without --force resumes it) first"
        )
    rep, report = read_report(cfg)
    changed = report_changes(cfg, report)
    if changed:  # (a report with changes is a dict) settings 01 took from its command line: a re-run needs them again
        cli = report.get("cli_overrides", [])
        cli = (
            [k for k in cli if k in ("source", "format", "regenerate")]
            if isinstance(cli, list)
            else []
        )
        again = (
            f" (it was run with {', '.join('--' + k for k in cli)} on its command line: give "
            f"{'them' if len(cli) > 1 else 'it'} again, or put {'them' if len(cli) > 1 else 'it'} in the config)"
            if cli
            else ""
        )
        content = [
            c for c in changed if c.startswith("the content of ")
        ]  # a source file edited since 01
        keys = [c for c in changed if c not in content]
        what = "; ".join(content + ([f"changed {'; '.join(keys)}"] if keys else []))
        raise UserError(
            f"{rep}: {cfg.prompts_path.name} was made with other prompts settings than this config's "
            f"({what}); re-run 01_prepare_prompts.py with this config first{again}"
        )


def warn_limit_drops_self_instruct(cfg: RunConfig, limit: int) -> Optional[str]:
    """Warn (one line; also returned) when ``--limit`` leaves out ``prompts.self_instruct`` prompts, which 01 puts
    after the sampled sources: how many, from ``prompts_report.json``'s counts (``self_instruct`` added, less those
    01's own ``--limit`` left out, at the end of ``kept``). None: nothing left out, or no such report."""
    from eagle3.prompts.prepare_prompts import limit_drops_self_instruct, read_report

    _, report = read_report(cfg)
    c = report.get("counts") if isinstance(report, dict) else None
    if (
        not isinstance(c, dict)
        or not isinstance(c.get("self_instruct"), int)
        or not isinstance(c.get("kept"), int)
    ):
        return None
    n_si = c["self_instruct"] - min(
        c["self_instruct"], int(c.get("limited_out") or 0)
    )  # those in prompts.jsonl
    dropped = min(n_si, c["kept"] - limit)
    if dropped <= 0:
        return None
    text = limit_drops_self_instruct("--limit", limit, n_si, dropped, c["kept"])
    log.warning(text)
    return text


def finished_report(cfg: RunConfig, root: Path, limit: Optional[int]) -> Optional[dict]:
    """``extract_report.json`` of a finished extraction of exactly this run, else None (the run goes on).

    Finished: ``extract_state.json`` and ``data_config.json`` carry this config's fingerprint
    (:func:`fingerprint`) and prompts SHA-256, the report counts at least the prompts this run reads (a ``--limit``
    at or below the finished run's prompts is a prefix of them: nothing to do),
    ``manifest.jsonl`` holds ``data_config.json``'s ``num_samples`` rows (no torn line, no per-rank manifest
    left), every row's shard is at its place, and ``data_config.json``'s ``verifier_weights`` (when recorded) are the
    weights at ``verifier.path`` now (:func:`_weights_changed`; reads 1 MiB a weight file). Reads only; needs no
    verifier model or tokenizer.
    """
    paths = [root / name for name in (STATE, DATA_CONFIG, REPORT_JSON, MANIFEST)]
    if not all(p.is_file() for p in paths) or any(root.glob(RANK_MANIFEST_PREFIX + "*.jsonl")):
        return None
    try:
        state, meta, report = (read_json(p) for p in paths[:3])
        prompts_sha = file_sha256(cfg.prompts_path)
        n_prompts = len(read_prompts(cfg.prompts_path, limit))
    except (UserError, OSError):
        return None  # let the normal run report the problem
    if not all(isinstance(x, dict) for x in (state, meta, report)):
        return None
    fp, _ = fingerprint(cfg, prompts_sha)
    if (
        (state.get("fingerprint"), meta.get("config_fingerprint"), meta.get("prompts_sha256"))
        != (fp, fp, prompts_sha)
        or not isinstance(report.get("prompts"), int)
        or n_prompts > report["prompts"]
        or report.get("samples") != meta.get("num_samples")
    ):
        return None
    if _weights_changed(
        root, {"verifier_weights": meta.get("verifier_weights")}, _weights_record(cfg)
    ):
        return None  # other weights at the same verifier.path: the run goes on and refuses the folder in one line
    man = read_manifest(root / MANIFEST)
    if man.dropped_tail or len(man.rows) != meta.get("num_samples"):
        return None
    rows_per_dir = cfg.extract.rows_per_dir
    if not all(shard_path(root, idx, rows_per_dir).is_file() for idx in man.rows):
        return None
    return report


def _iter_stage_files(root: Path):
    for entry in root.iterdir():
        if entry.name == STATE:
            continue
        if (entry.is_dir() and entry.name.startswith("rows_")) or (
            entry.is_file() and _is_stage_file(entry)
        ):
            yield entry


def _resume_state(
    root: Path, samples: list[Sample], rows_per_dir: int, expect: dict, writer_path: Path
) -> dict[int, dict]:
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
                raise UserError(
                    f"{writer_path}: sample {idx} is recorded as prompt '{row['id']}' but the prompts "
                    f"file gives '{s.id}'; re-run with --overwrite"
                )
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
            ok = (
                got["input_ids"].tolist() == s.input_ids
                and got["loss_mask"].tolist() == s.loss_mask
            )
        except UserError:
            ok = False
        if ok:
            done[idx] = {
                "idx": idx,
                "id": s.id,
                "num_tokens": len(s.input_ids),
                "num_loss_tokens": sum(s.loss_mask),
                DEFAULT_ALGO: file_checksum(on_disk[idx], DEFAULT_ALGO),
            }
            changed = True
        else:
            log.warning("%s: does not match its prompt; rewriting it", on_disk[idx])
            on_disk[idx].unlink()
    if changed:
        rewrite_manifest(writer_path, done)
    # The shard path depends on rows_per_dir; a row whose file is elsewhere is a foreign layout.
    for idx in done:
        if idx in by_idx and on_disk[idx] != shard_path(root, idx, rows_per_dir):
            raise UserError(
                f"{on_disk[idx]}: sample {idx} is not at {shard_path(root, idx, rows_per_dir)}; "
                "re-run with --overwrite"
            )
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
        raise UserError(
            "extract.sglang_url: required for backend sglang (or pass --server URL [URL ...])"
        )
    if not ex.capture_dir:
        raise UserError(
            "extract.capture_dir: required for backend sglang (where the patched server writes tensors)"
        )
    try:
        from eagle3.capture.multi import sglang_backend
    except ImportError as e:
        raise UserError(
            f"extract.backend: the sglang capture backend is not available ({e})"
        ) from e
    tok = load_tokenizer(cfg.verifier)
    n = verifier_dims(load_verifier_config(cfg.verifier))["num_layers"]
    layers = _resolve_aux(ex.aux_layers if aux_layers is None else aux_layers, n)
    # one URL: SGLangCapture; several (one per node): MultiServerCapture over them
    return sglang_backend(
        ex.sglang_url,
        ex.capture_dir,
        layers,
        timeout=ex.sglang_timeout_s,
        max_length=ex.max_length,
        max_requests=ex.requests_per_batch,
        per_server=ex.batches_in_flight_per_server,
        max_failures=ex.server_max_failures,
    ), tok


def _resolve_aux(layers: Optional[list[int]], num_layers: int) -> list[int]:
    if layers is None:
        return check_aux_layers(
            default_aux_layers(num_layers),
            num_layers,
            field="extract.aux_layers (default [2, N//2, N-3])",
        )
    return check_aux_layers(layers, num_layers, field="extract.aux_layers")


# ---------------------------------------------------------------------------------------------
# the stage
# ---------------------------------------------------------------------------------------------
def run(
    cfg: RunConfig,
    *,
    overwrite: bool = False,
    limit: Optional[int] = None,
    backend: Optional[CaptureBackend] = None,
    tokenizer=None,
    ignore_disk_check: bool = False,
) -> dict:
    """Run stage 02 (resumable). See the module docstring for the crash-safety design.

    Args:
        cfg: run config (``extract`` section, ``verifier``, ``prompts_path``, ``shards_dir``).
        overwrite: delete this stage's existing files in ``cfg.shards_dir`` and start over.
        limit: only the first ``limit`` prompts.
        backend, tokenizer: an already-built backend and tokenizer (tests, benchmarks); default
            :func:`make_backend`. Its ``aux_layers`` must be the configured/default ones.
        ignore_disk_check: capture even when the disk plan (:mod:`eagle3.capture.disk_plan`) does not fit.

    Returns:
        summary dict (also written as ``extract_report.json`` / ``.md``): samples, tokens,
        written/resumed counts, skipped counts, seconds, captured tokens/s. A finished folder of the same
        settings (:func:`finished_report`) is not touched: its ``extract_report.json`` with ``up_to_date: True``.

    Raises:
        UserError: bad prompts file, prompts made under other ``prompts:`` settings (:func:`check_prompts_current`),
            fingerprint mismatch, unknown folder contents, bad aux layers.
        eagle3.capture.disk_plan.NotEnoughDisk: the run does not fit on the disk (nothing written; a shards
            folder this call created is removed again).
    """
    from eagle3.capture.disk_plan import NotEnoughDisk
    from eagle3.process_group import process_group_scope

    root = cfg.shards_dir
    d = _init_dist()
    created = [
        p for p in (root, *root.parents) if not p.exists()
    ]  # folders this call may create, deepest first
    with process_group_scope(
        d.group, owned=d.initialized_here
    ):  # barrier on success only: peers may be stuck
        try:
            return _run(cfg, root, overwrite, limit, backend, tokenizer, d, ignore_disk_check)
        except (NotEnoughDisk, UserError):
            if created and d.rank == 0:
                _remove_fresh_folder(created)
            raise


def interrupt_hint(cfg: RunConfig) -> str:
    """What an interrupted 02 kept and how to go on (the line after ``interrupted by SIGTERM:``): the finished
    shards recorded in ``manifest.jsonl`` (and the torchrun ranks' ``manifest.rank*.jsonl``; read by
    :func:`eagle3.shards.manifest.read_manifest`, a torn last line not counted) and that the same command, without
    ``--overwrite`` (which deletes them), resumes."""
    root = cfg.shards_dir
    n = sum(
        len(read_manifest(p).rows)
        for p in [root / MANIFEST, *root.glob(RANK_MANIFEST_PREFIX + "*.jsonl")]
    )
    return f"{n} finished shards kept in {root}; re-run the same command (without --overwrite) to resume"


def _remove_fresh_folder(created: list[Path]) -> None:
    """Undo what a refused run did to the folders it created (``created``: the shards folder and the
    missing parents, deepest first): its state file, lock and the folders, only while they hold nothing
    else (captured shards are never removed here)."""
    root = created[0]
    if root.is_dir() and {p.name for p in root.iterdir()} <= {STATE, LOCK}:
        for name in (STATE, LOCK):
            (root / name).unlink(missing_ok=True)
    for folder in created:
        with contextlib.suppress(OSError):
            folder.rmdir()  # only when empty


def _run(
    cfg: RunConfig,
    root: Path,
    overwrite: bool,
    limit: Optional[int],
    backend: Optional[CaptureBackend],
    tokenizer,
    d: "_Dist",
    ignore_disk_check: bool,
) -> dict:
    if d.world == 1:
        make_dirs(root, cfg.output_field("shards"))
        with _exclusive(root):
            return _extract(cfg, root, overwrite, limit, backend, tokenizer, d, ignore_disk_check)
    if cfg.extract.backend != "hf" and backend is None:
        raise UserError(
            f"extract.backend: torchrun (WORLD_SIZE={d.world}) is supported for the hf backend only, "
            f"got '{cfg.extract.backend}'; run the sglang backend as one process"
        )
    cfg = _rank_config(cfg, d)
    with contextlib.ExitStack() as stack:

        def lock() -> None:
            make_dirs(root, cfg.output_field("shards"))
            stack.enter_context(_exclusive(root))  # rank 0 only; released when run() returns

        d.on_rank0(lock)
        return _extract(cfg, root, overwrite, limit, backend, tokenizer, d, ignore_disk_check)


@dataclass
class _Dist:
    """This process's place in a torchrun job (``world == 1``: no torch.distributed, no-op collectives).

    ``group`` is a gloo process group (CPU tensors only), so control traffic never touches a GPU.
    """

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    group: Any = None
    initialized_here: bool = False

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (pickled)."""
        if self.world == 1:
            return obj
        import torch.distributed as dist

        buf = [obj]
        dist.broadcast_object_list(buf, src=0, group=self.group)
        return buf[0]

    def all_gather(self, obj: Any) -> list:
        """``[obj of rank 0, ..., obj of rank world-1]`` on every rank; doubles as a barrier."""
        if self.world == 1:
            return [obj]
        import torch.distributed as dist

        out: list = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def on_rank0(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn()`` on rank 0 only and hand its result to every rank.

        An exception on rank 0 reaches all ranks (so none hangs in the next collective): a
        :class:`UserError` is re-raised with the same message everywhere, anything else is
        re-raised on rank 0 and becomes a ``RuntimeError`` on the others.
        """
        if self.world == 1:
            return fn()
        res, err, exc = None, None, None
        if self.rank == 0:
            try:
                res = fn()
            except BaseException as e:  # noqa: BLE001 - forwarded to the other ranks, then re-raised
                exc = e
                err = (
                    "user" if isinstance(e, UserError) else "bug",
                    str(e) if isinstance(e, UserError) else f"{type(e).__name__}: {e}",
                )
        res, err = self.broadcast((res, err))
        if exc is not None:
            raise exc
        if err is not None:
            if err[0] == "user":
                raise UserError(err[1])
            raise RuntimeError(f"stage 02 failed on rank 0: {err[1]}")
        return res


def _init_dist() -> _Dist:
    """torch.distributed (gloo) from the torchrun env when ``WORLD_SIZE > 1``; else a single process.

    Raises:
        UserError: ``WORLD_SIZE``/``RANK``/``LOCAL_RANK`` are not integers.
    """
    try:
        world = int(os.environ.get("WORLD_SIZE", "1") or 1)
        if world <= 1:
            return _Dist()
        rank = int(os.environ.get("RANK", "0"))
        local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    except ValueError as e:
        raise UserError(f"WORLD_SIZE/RANK/LOCAL_RANK: not an integer ({e})") from e
    import torch.distributed as dist

    from eagle3.process_group import init_process_group

    here = False
    if not dist.is_initialized():
        init_process_group(backend="gloo", timeout=DIST_TIMEOUT)
        here = True
    group = (
        dist.group.WORLD
        if dist.get_backend() == "gloo"
        else dist.new_group(backend="gloo", timeout=DIST_TIMEOUT)
    )
    return _Dist(rank=rank, world=world, local_rank=local_rank, group=group, initialized_here=here)


def _rank_config(cfg: RunConfig, d: _Dist) -> RunConfig:
    """A copy of ``cfg`` whose verifier sits on ``cuda:LOCAL_RANK`` (when it would use CUDA at all).

    ``verifier.device`` is not part of the fingerprint, so every rank still matches the folder.
    """
    import torch

    dev = str(cfg.verifier.device)
    if dev.startswith("cuda") or (dev == "auto" and torch.cuda.is_available()):
        cfg = cfg.model_copy(deep=True)
        cfg.verifier.device = f"cuda:{d.local_rank}"
        torch.cuda.set_device(d.local_rank)
    return cfg


def _exclusive(root: Path):
    """Exclusive ``flock`` on ``{root}/.extract.lock`` (:func:`eagle3.io.lock.exclusive_lock`).

    Raises:
        UserError: another stage-02 process is writing to ``root``.
    """
    return exclusive_lock(root / LOCK, f"another 02_extract_hidden run is writing to {root}")


def _check_disk(
    cfg: RunConfig,
    root: Path,
    samples: list[Sample],
    done: dict[int, dict],
    info: dict,
    skipped_ids: dict,
    ignore: bool,
    freed_by_overwrite: int = 0,
) -> dict:
    """Disk-plan step (rank 0, before any capture): :func:`eagle3.capture.disk_plan.plan_disk` of the samples
    not in ``done``; returns the plan as a dict (recorded in ``extract_report.json``/``.md``; not in
    data_config.json, whose content depends only on the data).

    ``freed_by_overwrite``: bytes of old shards that ``--overwrite`` deletes once the plan fits
    (:func:`wipe_frees_bytes`); counted as free, so a refused plan deletes nothing.

    Raises:
        eagle3.capture.disk_plan.NotEnoughDisk: the filesystem of ``root`` has less free space than needed.
    """
    from eagle3.capture.disk_plan import check_disk, plan_disk

    todo = [s for s in samples if s.idx not in done]
    storage = storage_from_config(
        cfg.extract
    )  # fp8: the plan measures fp8 shards (values + scales)
    encode = functools.partial(shard_object, storage=storage)
    hidden_bpt = bytes_per_token(info["hidden_size"], storage=storage)
    if token_only(cfg):  # the plan measures token-only shards: ids + mask, no hidden states
        encode, hidden_bpt = _token_encode, 0
    plan = plan_disk(
        root,
        [(s.id, len(s.input_ids)) for s in todo],
        hidden_size=info["hidden_size"],
        hidden_bytes_per_token=hidden_bpt,
        rows_per_dir=cfg.extract.rows_per_dir,
        pending_idx=[s.idx for s in todo],
        encode=encode,
        margin=cfg.extract.disk_margin,
        margin_bytes=cfg.extract.disk_margin_bytes,
        skipped_ids=skipped_ids,
        freed_by_overwrite=freed_by_overwrite,
    )
    return check_disk(plan, ignore).to_dict()


def _token_encode(input_ids, _hidden_states, loss_mask) -> dict:
    """The shard encoder of token-only samples for the disk plan (the states of the probe are dropped)."""
    return shard_object(input_ids, None, loss_mask)


def _expect(cfg: RunConfig, info: dict) -> dict:
    """What every shard of this run must hold (:func:`eagle3.shards.load_sample`'s ``expect``)."""
    if token_only(cfg):
        return {"vocab_size": info["vocab_size"], "tokens_only": True}
    return {
        "hidden_size": info["hidden_size"],
        "num_hidden_states": 4,
        "vocab_size": info["vocab_size"],
        "storage_dtype": storage_from_config(cfg.extract).dtype,
    }


@dataclass
class _Prepared:
    """What the plan step fixes before any capture: prompts, fingerprint, backend, samples, finished set."""

    prompts: list[dict]
    prompts_sha: str
    fp: str
    backend: Any
    tokenizer: Any
    info: dict
    aux: list[int]
    samples: list[Sample]
    counts: Counter
    skipped_ids: dict[str, list[str]]
    done: dict[int, dict]
    disk: dict


def _prepare(
    cfg: RunConfig,
    root: Path,
    overwrite: bool,
    limit: Optional[int],
    backend: Optional[CaptureBackend],
    tokenizer,
    d: _Dist,
    ignore_disk_check: bool,
) -> _Prepared:
    """Plan + tokenize steps: read prompts, check/prepare the folder (rank 0), build the backend,
    tokenize (:func:`tokenize_prompts`), reconcile the manifest with the shards and check the disk
    plan (rank 0, :func:`_check_disk`)."""
    prompts_path = cfg.prompts_path
    prompts = read_prompts(prompts_path, limit)
    prompts_sha = file_sha256(prompts_path)
    fp, comp = fingerprint(cfg, prompts_sha)
    # --overwrite deletes the old shards only once the disk plan of the new run fits (counting the space
    # they free): a refused run keeps them
    freed = d.on_rank0(lambda: wipe_frees_bytes(root)) if overwrite else 0

    def prepare_folder() -> None:
        _check_state(root, fp, comp, overwrite, _weights_record(cfg))
        stale = remove_stale_tmp(root)
        if stale:
            log.info("removed %d unfinished temporary files from an interrupted run", len(stale))
        merged = merge_rank_manifests(root)
        if merged:
            log.info("merged %d per-rank manifests of an interrupted multi-process run", merged)

    if not overwrite:
        d.on_rank0(prepare_folder)

    if backend is None:
        backend, tokenizer = make_backend(cfg)
    elif tokenizer is None:
        raise ValueError("run(): pass the tokenizer together with the backend")
    info = backend.info()
    aux = _resolve_aux(list(backend.aux_layers), info["num_layers"])
    if cfg.extract.aux_layers is not None and aux != list(cfg.extract.aux_layers):
        raise ValueError(
            f"backend captures {aux} but extract.aux_layers is {cfg.extract.aux_layers}"
        )
    check_servable(
        aux, cfg.export.engine, str(info["architecture"]), "extract.aux_layers"
    )  # before any capture

    check_token_ids(prompts, int(info["vocab_size"]), prompts_path)
    samples, counts, skipped_ids = tokenize_prompts(tokenizer, prompts, cfg, prompts_path)
    expect = _expect(cfg, info)

    def reconcile() -> dict[int, dict]:
        done = _resume_state(root, samples, cfg.extract.rows_per_dir, expect, root / MANIFEST)
        if any(s.idx not in done for s in samples):
            (root / DATA_CONFIG).unlink(missing_ok=True)  # present == complete
        return done

    if overwrite:  # plan first (nothing will be resumed), delete only when it fits
        disk = d.on_rank0(
            lambda: _check_disk(cfg, root, samples, {}, info, skipped_ids, ignore_disk_check, freed)
        )
        d.on_rank0(prepare_folder)
        done = d.on_rank0(reconcile)
    else:
        done = d.on_rank0(reconcile)
        disk = d.on_rank0(
            lambda: _check_disk(cfg, root, samples, done, info, skipped_ids, ignore_disk_check)
        )
    if d.rank == 0:
        log.info(
            "%d samples (%d already done), %d skipped",
            len(samples),
            len(done),
            counts["skipped_too_long"] + counts["skipped_no_loss_tokens"],
        )
    return _Prepared(
        prompts,
        prompts_sha,
        fp,
        backend,
        tokenizer,
        info,
        aux,
        samples,
        counts,
        skipped_ids,
        done,
        disk,
    )


def default_write_threads() -> int:
    """Writer threads for ``extract.write_threads: null``: the usable cores divided among the local
    torchrun ranks, at most 8 (enough to keep up with one H200 on SmolLM2-size shards)."""
    from eagle3.capture.tokenize_pool import default_workers

    return max(1, min(8, default_workers()))


def _start_capture(
    backend: CaptureBackend, batch: list[list[int]], storage: Optional[Storage] = None
):
    """Launch ``batch``'s capture; the handle's ``states()`` waits for it and returns per sample what
    the shard writer takes: :class:`eagle3.shards.format.StoredStates` from a backend whose
    ``capture_async`` accepts ``storage`` (HF: NaN/Inf check and fp8 quantisation done on the
    device per batch), else the 4 bf16 tensors of the capture contract (the writer checks and
    quantises them)."""
    start = getattr(backend, "capture_async", None)
    if callable(start):
        if "storage" in inspect.signature(start).parameters:
            handle = start(batch, storage=storage or Storage())
            return SimpleNamespace(states=handle.stored)
        return SimpleNamespace(states=start(batch).result)
    states = backend.capture(batch)
    return SimpleNamespace(states=lambda: states)


def capture_and_write(
    backend: CaptureBackend,
    samples: list[Sample],
    batches: list[list[int]],
    done: dict[int, dict],
    hidden_size: int,
    root: Path,
    rows_per_dir: int,
    manifest_path: Path,
    *,
    write_threads: int,
    max_pending_tokens: int,
    on_commit: Optional[Callable[[dict], None]] = None,
    storage: Optional[Storage] = None,
    checksum: str = DEFAULT_ALGO,
) -> list[dict]:
    """Capture + write steps: capture each batch of ``samples`` positions, write the shards of the
    samples not in ``done``, log them in ``manifest_path``; returns the new manifest rows (in order).

    ``write_threads > 0`` pipelines the work: batch k+1's forward is launched before batch k's
    states are waited for (``capture_async``, HF backend), and the shards are written by that many
    background threads (:class:`eagle3.capture.shard_writer.ShardWriter`, at most ``max_pending_tokens``
    tokens in flight). ``write_threads == 0`` is the serial loop. Both give the same shard bytes and
    the same manifest (rows appended in batch order, each after its shard is durable). ``done`` is
    updated as rows are appended. ``storage``: bf16 (None) or fp8 shards (:mod:`eagle3.shards.fp8`); a
    backend whose ``capture_async`` takes ``storage`` (HF) encodes each batch on its device
    (:func:`eagle3.shards.format.encode_batch`: NaN/Inf flag, fp8 quantisation) and hands over
    :class:`eagle3.shards.format.StoredStates`; the writer still refuses NaN/Inf before a shard is written.
    ``checksum``: the hash recorded per row (:mod:`eagle3.shards.checksum`). Used by stage 02 and by ``bench/extract_throughput.py``.

    Raises:
        RuntimeError: a backend broke its contract (:func:`eagle3.capture.base.check_captured`).
        UserError / OSError: a shard or manifest write failed (e.g. disk full).
    """
    sleep_s = float(os.environ.get(SLEEP_ENV, "0") or 0)
    rows: list[dict] = []

    def committed(row: dict) -> None:
        done[row["idx"]] = row
        rows.append(row)
        if on_commit is not None:
            on_commit(row)

    def write(group: list[int], handle) -> None:
        states = handle.states()
        if sleep_s:
            time.sleep(sleep_s)
        for i, st in zip(group, states):
            s = samples[i]
            if s.idx in done:
                continue
            check_captured(s.input_ids, st, hidden_size, f"sample {s.idx} ('{s.id}')")
            writer.submit(s.idx, s.id, s.input_ids, st, s.loss_mask)

    with (
        ManifestWriter(manifest_path) as man,
        ShardWriter(
            root,
            rows_per_dir,
            man,
            threads=write_threads,
            max_pending_tokens=max_pending_tokens,
            on_commit=committed,
            storage=storage,
            checksum=checksum,
        ) as writer,
    ):
        prev = None
        for group in batches:
            # Capture the whole planned batch (even finished members) so padded shapes match an
            # uninterrupted run exactly; only unfinished samples are written.
            handle = _start_capture(backend, [samples[i].input_ids for i in group], storage)
            if write_threads == 0:
                write(group, handle)
                continue
            if prev is not None:
                write(*prev)  # batch k-1's copy landed while batch k's forward was being launched
            prev = (group, handle)
        if prev is not None:
            write(*prev)
    return rows


def write_token_samples(
    samples: list[Sample],
    batches: list[list[int]],
    done: dict[int, dict],
    root: Path,
    rows_per_dir: int,
    manifest_path: Path,
    *,
    write_threads: int,
    max_pending_tokens: int,
    on_commit: Optional[Callable[[dict], None]] = None,
    checksum: str = DEFAULT_ALGO,
) -> list[dict]:
    """The write step of token-only samples (``train.hidden_states: online``): the pending samples of
    ``batches`` (positions into ``samples``), in batch order, as ``{input_ids, loss_mask}`` shards
    through the same :class:`eagle3.shard_writer.ShardWriter` (atomic files, checksums, manifest rows in
    order after each shard is durable) as :func:`capture_and_write`; no verifier forward. From
    :data:`eagle3.shards.format.TOKEN_PROCESS_MIN` samples on (and ``write_threads > 1``) the ``write_threads`` writers are processes
    (``ShardWriter(processes=True)``: the pickler holds the GIL). Returns the new rows.

    Raises:
        UserError / OSError: a shard or manifest write failed (e.g. disk full).
    """
    rows: list[dict] = []

    def committed(row: dict) -> None:
        done[row["idx"]] = row
        rows.append(row)
        if on_commit is not None:
            on_commit(row)

    n_todo = sum(samples[i].idx not in done for group in batches for i in group)
    procs = write_threads > 1 and n_todo >= shard_format.TOKEN_PROCESS_MIN
    with (
        ManifestWriter(manifest_path) as man,
        ShardWriter(
            root,
            rows_per_dir,
            man,
            threads=write_threads,
            max_pending_tokens=max_pending_tokens,
            on_commit=committed,
            checksum=checksum,
            processes=procs,
        ) as writer,
    ):
        for group in batches:
            for i in group:
                s = samples[i]
                if s.idx not in done:
                    writer.submit(s.idx, s.id, s.input_ids, None, s.loss_mask)
    return rows


def _flat(comp: dict) -> dict:
    """A fingerprint's components one level flat (``extract.max_length``), for naming the ones that differ."""
    return {
        f"{k}.{k2}" if isinstance(v, dict) else k: v2
        for k, v in comp.items()
        for k2, v2 in (v.items() if isinstance(v, dict) else [(None, v)])
    }


def _ranks_agree(cfg: RunConfig, d: _Dist) -> None:
    """Every torchrun rank must capture under rank 0's settings and prompts. Each rank reads the config and
    ``prompts.jsonl`` itself; one that read other ones (a node with another copy) tokenized another sample set, and
    rank 0 stopped in a ``RuntimeError: stage 02: samples [...] were assigned to no rank (bug)`` traceback after the
    capture, the per-rank manifests left behind. The ranks now compare their fingerprint components first.

    Raises:
        UserError: on every rank, naming the first rank that differs from rank 0 and the differing components.
    """
    if d.world == 1:
        return
    try:
        mine: Any = _flat(fingerprint(cfg, file_sha256(cfg.prompts_path))[1])
    except (UserError, OSError) as e:
        mine = f"cannot read {cfg.prompts_path}: {e}"
    everyone = d.all_gather(mine)
    for r, theirs in enumerate(everyone):
        if theirs == everyone[0]:
            continue
        if isinstance(theirs, str) or isinstance(everyone[0], str):
            what = theirs if isinstance(theirs, str) else f"rank 0: {everyone[0]}"
        else:
            what = "differing: " + ", ".join(
                sorted(
                    k for k in set(theirs) | set(everyone[0]) if theirs.get(k) != everyone[0].get(k)
                )
            )
        raise UserError(
            f"{cfg.shards_dir}: torchrun rank {r} read other 02 settings or prompts than rank 0 ({what}); "
            f"every rank must read the same config and {cfg.prompts_path} (a node with another copy?)"
        )


def _extract(
    cfg: RunConfig,
    root: Path,
    overwrite: bool,
    limit: Optional[int],
    backend: Optional[CaptureBackend],
    tokenizer,
    d: _Dist,
    ignore_disk_check: bool = False,
) -> dict:
    """The stage in named steps: check the prompts (:func:`check_prompts_current`), nothing to do
    (:func:`finished_report`), prepare (plan + tokenize + disk check), capture + write, gather ranks, finalise."""
    t_start = time.perf_counter()
    d.on_rank0(lambda: check_prompts_current(cfg))
    _ranks_agree(cfg, d)
    if limit is not None:
        d.on_rank0(lambda: warn_limit_drops_self_instruct(cfg, limit))
    finished = None if overwrite else d.on_rank0(lambda: finished_report(cfg, root, limit))
    if finished is not None:  # every rank returns; the reports are left as they are
        if d.rank == 0:
            log.info(
                "shards up to date: %s (%d samples, settings unchanged; use --overwrite to redo)",
                root,
                finished["samples"],
            )
            unchecked = _weights_unchecked(root, _read_state(root), _weights_record(cfg))
            if unchecked:
                log.warning("%s", unchecked)
        return {**(finished if d.rank == 0 else {"shards_dir": str(root)}), "up_to_date": True}
    p = _prepare(cfg, root, overwrite, limit, backend, tokenizer, d, ignore_disk_check)
    samples, done = p.samples, p.done
    n_resumed = len(done)
    plan = plan_batches([len(s.input_ids) for s in samples], cfg.extract.batch_tokens)
    # Batches with a pending sample, in plan order; rank r takes every world-th one. The batches
    # themselves come from the global plan, so padding (and every tensor) matches one process.
    todo = [g for g in plan if any(samples[i].idx not in done for i in g)]
    mine = todo[d.rank :: d.world]
    total_tok = sum(len(s.input_ids) for s in samples)
    done_tok = sum(len(s.input_ids) for s in samples if s.idx in done)
    my_tok = sum(len(samples[i].input_ids) for g in mine for i in g if samples[i].idx not in done)
    shown_done = done_tok if d.world == 1 else 0
    my_man = root / MANIFEST if d.world == 1 else root / rank_manifest_name(d.rank)
    desc = "capture" if d.world == 1 else f"capture rank {d.rank}/{d.world}"
    threads = cfg.extract.write_threads
    t_cap = time.perf_counter()
    # several SGLang servers: the batch plan is announced so batches are captured ahead, in parallel
    ahead = [] if token_only(cfg) else [[samples[i].input_ids for i in g] for g in mine]
    with (
        prefetching(p.backend, ahead),
        tqdm(
            total=shown_done + my_tok,
            initial=shown_done,
            unit="tok",
            unit_scale=True,
            desc=desc,
            mininterval=1.0,
            position=d.rank,
        ) as bar,
    ):
        wt = default_write_threads() if threads is None else threads
        if token_only(cfg):
            my_rows = write_token_samples(
                samples,
                mine,
                done,
                root,
                cfg.extract.rows_per_dir,
                my_man,
                write_threads=wt,
                max_pending_tokens=2 * cfg.extract.batch_tokens,
                on_commit=lambda row: bar.update(row["num_tokens"]),
            )
        else:
            try:
                my_rows = capture_and_write(
                    p.backend,
                    samples,
                    mine,
                    done,
                    p.info["hidden_size"],
                    root,
                    cfg.extract.rows_per_dir,
                    my_man,
                    write_threads=wt,
                    max_pending_tokens=2 * cfg.extract.batch_tokens,
                    on_commit=lambda row: bar.update(row["num_tokens"]),
                    storage=storage_from_config(cfg.extract),
                )
            except (
                NonFiniteStates
            ) as e:  # name the layer and the dtype the verifier ran in (one error line)
                raise e.explained(
                    aux_layers=p.aux,
                    dtype=cfg.verifier.dtype if cfg.extract.backend == "hf" else None,
                ) from None
    written = len(my_rows)
    t_cap = time.perf_counter() - t_cap
    captured_tok = total_tok - done_tok
    ranks: list[dict] = []
    if d.world > 1:
        # The all-gather is the barrier after which rank 0 alone finalises the folder.
        mine_stats = _rank_stats(d.rank, written, my_tok, t_cap)
        gathered = d.all_gather({**mine_stats, "rows": my_rows})
        if d.rank != 0:
            return {**mine_stats, "world_size": d.world, "shards_dir": str(root)}
        written, t_cap = _gather_ranks(root, samples, done, gathered, ranks)
    return _finalise(cfg, root, p, n_resumed, written, t_cap, captured_tok, t_start, d, ranks)


def _gather_ranks(
    root: Path,
    samples: list[Sample],
    done: dict[int, dict],
    gathered: list[dict],
    ranks: list[dict],
) -> tuple[int, float]:
    """Rank 0, multi-process: fold every rank's rows into ``done``, merge the rank manifests;
    returns ``(written, capture wall seconds)`` over all ranks."""
    for g in gathered:
        for row in g.pop("rows"):
            done[row["idx"]] = row
        ranks.append(g)
        log.info(
            "rank %d: %d samples in %.1f s = %s samples/s (%s tok/s)",
            g["rank"],
            g["written"],
            g["capture_s"],
            rate_text(g["samples_per_s"]),
            rate_text(g["tokens_per_s"]),
        )
    missing = [s.idx for s in samples if s.idx not in done]
    if missing:
        raise RuntimeError(f"stage 02: samples {missing[:10]} were assigned to no rank (bug)")
    merge_rank_manifests(root)
    return sum(g["written"] for g in ranks), max(
        g["capture_s"] for g in ranks
    )  # wall time of the parallel capture


def _weights_record(cfg: RunConfig) -> dict:
    """``{"verifier_weights": fingerprint}`` of the verifier's weight files
    (:func:`eagle3.verifier.weights_fingerprint`), or ``{}`` when its folder holds none: 03 and 04 compare it
    (:func:`eagle3.shards.format.check_verifier`), so a
    ``verifier.path`` pointed at another model under the same ``verifier.name`` is refused, not trained against."""
    from eagle3.verifier import weights_record

    return weights_record(cfg.verifier)


def _finalise(
    cfg: RunConfig,
    root: Path,
    p: _Prepared,
    n_resumed: int,
    written: int,
    t_cap: float,
    captured_tok: int,
    t_start: float,
    d: _Dist,
    ranks: list[dict],
) -> dict:
    """Finalise step: ``data_config.json`` (written last: marks the extraction complete) and the report."""
    done, info, counts = p.done, p.info, p.counts
    rows = [done[k] for k in sorted(done)]
    num_tokens = sum(r["num_tokens"] for r in rows)
    num_loss = sum(int(r.get("num_loss_tokens", 0)) for r in rows)
    rows_per_dir = cfg.extract.rows_per_dir
    from eagle3.prompts.chat import chat_template_hash, end_of_turn_ids

    storage = storage_from_config(cfg.extract)
    tokens = token_only(cfg)
    meta = {
        **(tokens_meta() if tokens else storage_meta(storage)),  # format, dtype (+ fp8 scale keys)
        "verifier": cfg.verifier.display_name(),
        "architecture": info["architecture"],
        "num_layers": info["num_layers"],
        "hidden_size": info["hidden_size"],
        "vocab_size": info["vocab_size"],
        "aux_layers": p.aux,
        "layer_index_convention": LAYER_INDEX_CONVENTION,
        "last_hidden_state": info["last_hidden_state"],
        "max_length": cfg.extract.max_length,
        "rows_per_dir": rows_per_dir,
        "chat_template_hash": chat_template_hash(p.tokenizer, cfg.verifier.chat_template),
        "config_fingerprint": p.fp,
        "prompts_sha256": p.prompts_sha,
        "prompts_file": str(cfg.prompts_path),
        "backend": cfg.extract.backend,
        **(
            {"sglang_tp_size": cfg.extract.sglang_tp_size}
            if cfg.extract.backend == "sglang"
            else {}
        ),
        "num_samples": len(rows),
        "num_tokens": num_tokens,
        "num_loss_tokens": num_loss,
        "bytes_per_token": 0 if tokens else bytes_per_token(info["hidden_size"], storage=storage),
        "skipped": {k: int(v) for k, v in sorted(counts.items()) if k.startswith("skipped")},
        "truncated": int(counts["truncated"]),
        "chat_template_kwargs": dict(cfg.verifier.chat_template_kwargs),
        "loss_on_reasoning": cfg.extract.loss_on_reasoning,
        **(
            {"verifier_dtype": cfg.verifier.dtype} if cfg.extract.backend == "hf" else {}
        ),  # named in 03's NaN/Inf errors
        **_weights_record(
            cfg
        ),  # which model's weights: 03/04 refuse another one under the same verifier.name
        "stop_token_ids": sorted(
            end_of_turn_ids(p.tokenizer)
        ),  # the loss mask's turn end (eagle3.verifier.stop_token_ids)
        "split": {
            "conversations": int(counts["split_conversations"]),
            "samples": int(counts["split_samples"]),
        },
        "skipped_ids": p.skipped_ids,
    }
    write_data_config(root, meta)
    summary = {
        "shards_dir": str(root),
        "prompts": len(p.prompts),
        "samples": len(rows),
        "written": written,
        "resumed": n_resumed,
        "num_tokens": num_tokens,
        "num_loss_tokens": num_loss,
        "skipped": meta["skipped"],
        "truncated": meta["truncated"],
        "split_conversations": meta["split"]["conversations"],
        "split_samples": meta["split"]["samples"],
        "skipped_ids": p.skipped_ids,
        "capture_s": round(t_cap, 3),
        "total_s": round(time.perf_counter() - t_start, 3),
        "captured_tokens_per_s": round(captured_tok / t_cap, 1)
        if t_cap > 0 and captured_tok
        else None,
        "disk_gb": round(
            num_tokens * (TOKEN_BYTES_PER_TOKEN if tokens else meta["bytes_per_token"]) / 1e9, 4
        ),
        "disk_plan": p.disk,
        **({"servers": p.backend.server_summary()} if hasattr(p.backend, "server_summary") else {}),
    }
    if d.world > 1:
        summary["world_size"] = d.world
        summary["samples_per_s"] = round(written / t_cap, 2) if t_cap > 0 and written else None
        summary["ranks"] = ranks
        log.info(
            "all %d ranks: %d samples in %.1f s = %s samples/s",
            d.world,
            written,
            t_cap,
            rate_text(summary["samples_per_s"]),
        )
    atomic_write_json(root / REPORT_JSON, summary)
    atomic_write_text(root / REPORT_MD, _markdown(summary))
    return summary


def _rank_stats(rank: int, written: int, captured_tokens: int, capture_s: float) -> dict:
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


def _markdown(s: dict) -> str:
    lines = ["# Stage 02: hidden-state extraction", "", "| metric | value |", "|---|---:|"]
    for k in (
        "prompts",
        "samples",
        "split_conversations",
        "split_samples",
        "written",
        "resumed",
        "num_tokens",
        "num_loss_tokens",
        "truncated",
        "capture_s",
        "total_s",
        "captured_tokens_per_s",
        "disk_gb",
    ):
        lines.append(f"| {k} | {rate_text(s[k])} |")
    for k, v in s["skipped"].items():
        lines.append(f"| {k} | {v} |")
    for reason, ids in s.get("skipped_ids", {}).items():
        lines.append(
            f"| skipped ({reason}) | {', '.join(ids[:20])}{' ...' if len(ids) > 20 else ''} |"
        )
    if s.get("disk_plan"):
        from eagle3.capture.disk_plan import DiskPlan

        lines += ["", DiskPlan(**s["disk_plan"]).describe()]
    return "\n".join(lines) + "\n"
