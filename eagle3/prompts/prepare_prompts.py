"""Stage 01 orchestration: read -> normalise -> dedupe -> sample -> (+ self-instruct prompts) -> (regenerate) ->
prompts.jsonl.

Outputs (both written atomically, so a failed or killed run leaves no half-written file):

* ``cfg.prompts_path`` (``{output_root}/prompts.jsonl``): one ``{"id", "messages"}`` per line;
* ``prompts_report.json`` next to it: the settings fingerprint and the counts
  (``read``, ``skipped`` by reason, ``dropped_leading_assistant``, ``deduped``, ``sampled_out``,
  with ``prompts.self_instruct`` ``self_instruct`` / ``self_instruct_deduped`` (its prompts added on top of the
  sampled sources / dropped as duplicates of them), ``limited_out`` (with ``prompts.self_instruct``:
  ``self_instruct_limited_out``, those of its prompts ``--limit`` left out), with ``prompts.regenerate``
  ``dropped_over_context`` (and ``failed`` through endpoints), ``kept``, ``regenerated``, regeneration
  ``new_tokens``/``truncated``/``tokens_per_s``),
  and the same counts as a Markdown table in ``prompts_report.md``.

Idempotent: every step is deterministic (seeded sampling, greedy decoding), and when both outputs
exist with the same settings fingerprint (:func:`settings`: the config fields that change the output, source file
size + SHA-256, the verifier and, regenerating in-process, its weights' fingerprint; with ``prompts.self_instruct``
its settings and its file's size + SHA-256) the stage does nothing and says so
(``force=True`` recomputes). A forced run first writes :data:`FORCED_NAME` beside ``prompts.jsonl`` and removes it
only once the new outputs are written: while it is there the old outputs are not up to date (a forced run that was
interrupted or crashed is redone, resuming its regeneration log, by the same command without ``--force``), and
02 refuses the old ``prompts.jsonl``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections import Counter
from pathlib import Path
from typing import Optional, Sequence

from pydantic import ValidationError

from eagle3.config import RunConfig
from eagle3.config.loader import at_item, field_path
from eagle3.config.prompts import PromptsConfig
from eagle3.errors import UserError
from eagle3.io import atomic_write_json, atomic_write_jsonl, atomic_write_text, make_dirs
from eagle3.io.lock import exclusive_lock
from eagle3.io.read import file_sha256
from eagle3.prompts.chat import ANSWER_FIELDS, ChatOptions, common_answer_fields, end_of_turn_ids
from eagle3.prompts.readers import (
    dedupe,
    read_conversations,
    sample,
    short_pool_warning,
    unique_ids,
)
from eagle3.prompts.resume_log import comparable_settings

log = logging.getLogger(__name__)

REPORT_NAME = "prompts_report.json"
FORCED_NAME = "prompts.forced-run.json"  # beside prompts.jsonl from a --force run's start until its outputs are written


def report_markdown(report: dict) -> str:
    """The report's counts (and regeneration figures) as a Markdown table."""
    c = report["counts"]
    rows = [("read", c["read"])]
    rows += [(f"skipped: {k}", v) for k, v in c["skipped"].items()]
    rows += [
        (_COUNT_LABELS.get(k, k), c[k])
        for k in (
            "dropped_leading_assistant",
            "normalised",
            "deduped",
            "sampled_out",
            "self_instruct",
            "self_instruct_deduped",
            "limited_out",
            "self_instruct_limited_out",
            "dropped_over_context",
            "failed",
            "kept",
            "regenerated",
            "inline_reasoning_split",
        )
        if k in c
    ]
    reg = report.get("regeneration")
    if reg:
        if "via" in reg:
            rows += [("regeneration: via", reg["via"])]
        if "failed" in reg:
            rows += [
                ("regeneration: failed conversations", reg["failed"]),
                ("regeneration: retried requests", reg["retries"]),
            ]
        if "failed" in reg or reg.get(
            "resumed"
        ):  # a resumed run: its figures below cover the conversations it answered
            rows += [
                (
                    "regeneration: conversations resumed from the log (answered by an earlier run; the regeneration "
                    "figures below count this run's only)",
                    reg.get("resumed", 0),
                )
            ]
        if "sampling" in reg:
            rows += [
                (f"sampling: {k}", json.dumps(v) if isinstance(v, dict) else v)
                for k, v in reg["sampling"].items()
            ]
        es = reg.get("engine_stats") or []
        es = [
            e for e in ([es] if isinstance(es, dict) else es) if e and "reused_tokens" in e
        ]  # slot engines, per replica
        if es:
            reused, fed = sum(e["reused_tokens"] for e in es), sum(e["prefill_tokens"] for e in es)
            rows += [
                (
                    "regeneration: prompt tokens prefilled / reused from the previous turn",
                    f"{fed} / {reused} ({100.0 * reused / max(1, reused + fed):.1f}% reused)",
                )
            ]
        if reg.get("turns_over_context"):
            rows += [
                ("regeneration: user turns not answered (context cap)", reg["turns_over_context"])
            ]
        if reg.get("kept_with_tools"):
            rows += [
                (
                    "regeneration: conversations with tool results kept as they are",
                    reg["kept_with_tools"],
                )
            ]
        rows += [
            ("regeneration: new tokens", reg["new_tokens"]),
            ("regeneration: truncated answers", reg["truncated"]),
            ("regeneration: seconds", f"{reg['seconds']:.1f}"),
            (
                "regeneration: tokens/s",
                f"{reg['tokens_per_s']:.1f}" if reg["tokens_per_s"] else "n/a",
            ),
        ]
    st = report["settings"]
    src = st["source"] if "source" in st else ", ".join(x["source"] for x in st["sources"])
    lines = ["# Stage 01: prompts", "", f"source: `{src}`", "", "| item | value |", "|---|---:|"]
    lines += [f"| {k} | {v} |" for k, v in rows]
    return "\n".join(lines) + "\n"


# Markdown labels of counts whose key alone would not say what they count
_COUNT_LABELS = {
    "dropped_over_context": "dropped_over_context (first prompt at the context cap)",
    "failed": "failed (regeneration)",
    "regenerated": "regenerated (conversations)",
}


def _had_failures(report: dict) -> bool:
    """Whether the regeneration recorded in a read ``prompts_report.json`` (:func:`read_report`) had failures."""
    return bool((report.get("regeneration") or {}).get("failed"))


def read_counts_text(counts: Counter) -> str:
    """What reading the sources found, for messages: ``no records`` or ``read 3 records, skipped 3 (no
    assistant: 2, empty content: 1)`` (the ``skipped_<reason>`` counters of :mod:`eagle3.prompts.readers`, nonzero only)."""
    read = counts.get("read", 0)
    if not read:
        return "no records"
    reasons = [
        (k[len("skipped_") :].replace("_", " "), v)
        for k, v in sorted(counts.items())
        if k.startswith("skipped_") and v
    ]
    text = f"read {read} record{'s' if read != 1 else ''}"
    if reasons:
        text += (
            f", skipped {sum(v for _, v in reasons)} ("
            + ", ".join(f"{r}: {v}" for r, v in reasons)
            + ")"
        )
    return text


def report_path(cfg: RunConfig) -> Path:
    """``prompts_report.json`` next to ``cfg.prompts_path``."""
    return cfg.prompts_path.parent / REPORT_NAME


SOURCE_STATS = (
    "source_stats"  # prompts_report.json key: {resolved source path: {bytes, mtime_ns, sha256}}
)


def _source_fingerprint(
    source: str, known: Optional[dict] = None, seen: Optional[dict] = None
) -> dict:
    """``{"source", "bytes", "sha256"}`` of a source file or a local HF dataset folder (:func:`_hf_folder_fingerprint`;
    ``{"source"}`` for a named set or a missing file).

    Args:
        known: the report's :data:`SOURCE_STATS` (``{resolved path: {"bytes", "mtime_ns", "sha256"}}``): a recorded
            hash is reused when the file's size (bytes) and ``st_mtime_ns`` (nanoseconds) equal the recorded ones,
            else the file is hashed (all of it: slow for a large source).
        seen: filled with this file's entry of :data:`SOURCE_STATS` (the size and mtime taken before hashing, so
            a file written during the hash is hashed again next time).
    """
    p = Path(source)
    if source.startswith("hf:") and Path(source[3:]).is_dir():
        return _hf_folder_fingerprint(source, Path(source[3:]), known, seen)
    if source.startswith("hf:") or source == "humaneval" or not p.is_file():
        return {"source": source}
    st, key = p.stat(), str(p.resolve())
    rec = known.get(key) if isinstance(known, dict) else None
    if (
        isinstance(rec, dict)
        and isinstance(rec.get("sha256"), str)
        and (rec.get("bytes"), rec.get("mtime_ns")) == (st.st_size, st.st_mtime_ns)
    ):
        sha = rec["sha256"]
    else:
        sha = file_sha256(p)
    if seen is not None:
        seen[key] = {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha}
    return {"source": source, "bytes": st.st_size, "sha256": sha}


def _hf_folder_fingerprint(
    source: str, folder: Path, known: Optional[dict], seen: Optional[dict]
) -> dict:
    """``{"source", "bytes", "sha256"}`` of a local Hugging Face dataset folder (``hf:<path>``, ``save_to_disk`` or data
    files): the sha256 over each file's path in the folder and its content hash (entries starting with ``.`` left
    out), each file's hash reused while its size and mtime hold (``known`` / ``seen``, as for a source file). Before,
    such a source was recorded by its name alone: a dataset saved there again left ``prompts.jsonl`` "up to date" and
    02 accepted it."""
    import hashlib

    h, total = hashlib.sha256(), 0
    files = sorted(
        f
        for f in folder.rglob("*")
        if f.is_file() and not any(part.startswith(".") for part in f.relative_to(folder).parts)
    )
    for f in files:
        fp = _source_fingerprint(str(f), known, seen)
        h.update(f"{f.relative_to(folder).as_posix()}\0{fp['sha256']}\n".encode())
        total += fp["bytes"]
    return {"source": source, "bytes": total, "sha256": h.hexdigest()}


def settings(
    cfg: RunConfig, limit: Optional[int], known: Optional[dict] = None, seen: Optional[dict] = None
) -> dict:
    """The inputs that determine the outputs (stored in the report; equal settings = nothing to do).

    ``known`` / ``seen``: a source file's recorded size, mtime and hash, reused / recorded
    (:func:`_source_fingerprint`); the settings are the same either way.

    Only settings that change the output count (``eagle3.prompts.resume_log.CONDITIONAL_KEYS``): ``seed`` with
    ``prompts.sample_size`` or ``prompts.self_instruct`` (it seeds both samplings; nothing else is random), ``hf_split`` with an ``hf:`` source, ``top_p`` with a server
    ``temperature`` above 0, ``verifier_dtype`` with the in-process regeneration, which also records the verifier's
    weights (``verifier_weights``, :func:`eagle3.verifier.weights_fingerprint`, when its folder holds weight files):
    ``verifier.path`` pointed at other weights under the same ``verifier.name`` remakes the answers.
    """
    from eagle3.verifier import weights_record

    pc = cfg.prompts
    sources = [pc.source] if isinstance(pc.source, str) else list(pc.source)
    s = {
        "format": pc.format,
        "sample_size": pc.sample_size,
        "dedupe": pc.dedupe,
        "system_prompt": pc.system_prompt,
        "regenerate": pc.regenerate,
        "limit": limit,
        **(
            _source_fingerprint(pc.source, known, seen)
            if isinstance(pc.source, str)
            else {"sources": [_source_fingerprint(x, known, seen) for x in pc.source]}
        ),
    }
    if (
        pc.sample_size is not None or pc.self_instruct is not None
    ):  # the sample's and the self-instruct sampling's
        s["seed"] = pc.seed  # seed; without either it picks nothing
    if any(x.startswith("hf:") for x in sources):  # the split read from a Hugging Face dataset
        s["hf_split"] = pc.hf_split
    if pc.regenerate:
        s.update(
            max_new_tokens=pc.max_new_tokens,
            max_context_tokens=max_context_tokens(cfg),
            verifier=cfg.verifier.display_name(),
            chat_template=cfg.verifier.chat_template,
        )
        if (
            pc.regenerate_via == "local"
        ):  # the weights and dtype that answer (endpoints answer with their own model)
            s.update(verifier_dtype=cfg.verifier.dtype, **weights_record(cfg.verifier))
        # template arguments and reply start shape the prompts the verifier answers (recorded only when set,
        # so reports written before these settings existed stay up to date)
        for key in ("chat_template_kwargs", "reply_start"):
            if getattr(cfg.verifier, key):
                s[key] = getattr(cfg.verifier, key)
        if (
            pc.regenerate_via != "local"
        ):  # endpoints, concurrency and timeouts may change between runs
            s.update(
                regenerate_via=pc.regenerate_via,
                temperature=pc.temperature,
                model=pc.server.model,
                extra_body=pc.server.extra_body,
            )
            if pc.temperature > 0:  # greedy (temperature 0) takes the top token whatever top_p is
                s["top_p"] = pc.top_p
    if tuple(cfg.verifier.think_tags) != ("<think>", "</think>"):
        s["think_tags"] = list(cfg.verifier.think_tags)
    if (
        pc.self_instruct is not None
    ):  # its settings, and its file (remade when its own report's settings change)
        # batch_size is left out: the file's sha256 covers it, and reports made before it was a key stay up to date
        s["self_instruct"] = {
            **pc.self_instruct.model_dump(exclude={"batch_size"}),
            "file": _source_fingerprint(str(cfg.self_instruct_path), known, seen),
        }
    return s


def forced_path(cfg: RunConfig) -> Path:
    """The marker of a ``--force`` run that has not finished (:data:`FORCED_NAME`, next to ``cfg.prompts_path``):
    while it exists the outputs there are not up to date, whatever their report says."""
    return cfg.prompts_path.parent / FORCED_NAME


def mark_forced(cfg: RunConfig) -> None:
    """Write :func:`forced_path` (atomically; rank 0, under the writer lock) before a ``--force`` run changes
    anything, so that a forced run stopped half-way leaves its old outputs marked as not up to date. Nothing to
    mark without a ``prompts.jsonl`` (no old output to take for current)."""
    import time

    if not cfg.prompts_path.is_file():
        return
    atomic_write_json(
        forced_path(cfg),
        {
            "started_at": time.time(),
            "outputs": str(cfg.prompts_path),
            "note": "a 01_prepare_prompts.py --force run has not finished; re-run it",
        },
    )


def partial_path(cfg: RunConfig) -> Path:
    """The regeneration resume log (either path: endpoints or in-process), next to ``cfg.prompts_path``."""
    from eagle3.prompts.resume_log import PARTIAL_NAME

    return cfg.prompts_path.parent / PARTIAL_NAME


def interrupt_hint(cfg: RunConfig, regenerate: Optional[bool] = None) -> str:
    """What an interrupted 01 kept and how to go on (the line after ``interrupted by SIGTERM:``): the number of
    distinct regenerated conversations in the resume logs (every rank's) and that the same command, without
    ``--force`` (which discards them), resumes. ``regenerate``: the command line's ``--regenerate`` /
    ``--no-regenerate`` (None: ``prompts.regenerate``); a run that does not regenerate keeps nothing (it writes
    ``prompts.jsonl`` at the end), and is told so rather than about regenerated answers."""
    from eagle3.prompts.replicas import all_logs
    from eagle3.prompts.resume_log import PARTIAL_NAME, logged_positions

    if not (cfg.prompts.regenerate if regenerate is None else regenerate):
        return f"nothing written ({cfg.prompts_path.name} is written at the end); re-run the same command"
    logs = all_logs(cfg.prompts_path.parent)
    if not logs:
        return "no regenerated answer was kept yet; re-run the same command (without --force) to start again"
    n = len(logged_positions(logs))
    pattern = cfg.prompts_path.parent / PARTIAL_NAME.replace(".jsonl", "*.jsonl")
    return (
        f"{n} regenerated conversation{'' if n == 1 else 's'} kept in {pattern}; "
        "re-run the same command (without --force) to resume"
    )


def _regenerate(
    cfg: RunConfig, convs: list[dict], want: dict, stats: dict, force: bool = False
) -> Optional[list[dict]]:
    """Regenerate the answers in-process (``local``, over the torchrun replicas if any: None on ranks > 0)
    or through the configured endpoints."""
    pc = cfg.prompts
    if pc.regenerate_via == "local":
        if pc.temperature != 0 or pc.top_p != 1:
            raise UserError(
                "prompts.temperature/top_p: the local path decodes greedily; sampling needs "
                "prompts.regenerate_via: sglang or openai"
            )
        from eagle3.prompts.regenerate import engine_options
        from eagle3.prompts.replicas import regenerate_replicas

        # one process, or one verifier replica per torchrun rank (None on ranks > 0: rank 0 writes)
        return regenerate_replicas(
            cfg,
            convs,
            want,
            stats,
            force=force,
            regen_kwargs=dict(
                max_new_tokens=pc.max_new_tokens,
                batch_size=pc.gen_batch_size,
                opts=ChatOptions.from_config(cfg),
                max_context=max_context_tokens(cfg),
                schedule=pc.gen_schedule,
                engine=pc.regen_engine,
                engine_options=engine_options(pc),
            ),
        )
    from eagle3.prompts.regen_server import regenerate_via_server
    from eagle3.verifier import load_tokenizer

    if not pc.server.urls:
        raise UserError(
            f"prompts.server.urls: needed for prompts.regenerate_via: {pc.regenerate_via}"
        )
    tok = load_tokenizer(cfg.verifier)
    stats["stop_token_ids"] = sorted(end_of_turn_ids(tok))
    return regenerate_via_server(
        convs,
        tok,
        pc,
        ChatOptions.from_config(cfg),
        partial_path=partial_path(cfg),
        settings=want,
        stats=stats,
        max_context=max_context_tokens(cfg),
    )


def _regenerate_reusing(
    cfg: RunConfig, convs: list[dict], want: dict, stats: dict, force: bool
) -> tuple[Optional[list[dict]], Optional[dict]]:
    """:func:`_regenerate`, with ``prompts.reuse_answers`` (:mod:`eagle3.prompts.reuse_answers`): the inputs an earlier
    regeneration answered under the same settings take its conversations, only the rest are regenerated, the output
    in input order. Returns ``(conversations or None on a torchrun rank > 0, {"file", "conversations"} or None)``."""
    from eagle3.prompts.replicas import all_logs
    from eagle3.prompts.resume_log import logged_answer_fields

    # the answer fields of what is resumed or reused (an older 01's answers lack stop_token): the report records
    # only the fields every answer of prompts.jsonl has (eagle3.prompts.chat.common_answer_fields)
    recorded = [] if force else [logged_answer_fields(all_logs(partial_path(cfg).parent))]
    if not cfg.prompts.reuse_answers:
        stats["answer_fields"] = common_answer_fields(list(ANSWER_FIELDS), *recorded)
        return _regenerate(cfg, convs, want, stats, force=force), None
    from eagle3.prompts import reuse_answers

    reused, todo = reuse_answers.split(convs, reuse_answers.load(cfg.prompts.reuse_answers, want))
    info = {"file": str(cfg.prompts.reuse_answers), "conversations": len(convs) - len(todo)}
    if info["conversations"]:
        recorded.append(reuse_answers.recorded_fields(cfg.prompts.reuse_answers))
    stats["answer_fields"] = common_answer_fields(list(ANSWER_FIELDS), *recorded)
    if _rank0():  # once under torchrun
        print(
            f"prompts.reuse_answers: {info['conversations']} of {len(convs)} conversations answered in "
            f"{cfg.prompts.reuse_answers}; regenerating {len(todo)}"
        )
    # nothing left to regenerate: rank 0 writes the outputs, a torchrun rank > 0 returns None as after a regeneration
    done = _regenerate(cfg, todo, want, stats, force=force) if todo else ([] if _rank0() else None)
    return (None if done is None else reuse_answers.merge(convs, reused, done)), info


def max_context_tokens(cfg: RunConfig) -> int:
    """Regeneration's context cap in tokens: ``prompts.max_context_tokens``, else ``extract.max_length``
    (02 cuts every sample there, so an answer that starts past it is never trained on)."""
    return cfg.prompts.max_context_tokens or cfg.extract.max_length


def run(
    cfg: RunConfig,
    source: Optional[str] = None,
    fmt: Optional[str] = None,
    regenerate: Optional[bool] = None,
    limit: Optional[int] = None,
    force: bool = False,
) -> int:
    """Run stage 01 and print where the outputs are.

    Steps: :func:`apply_overrides`; with ``prompts.self_instruct``, its file first (:func:`make_self_instruct`);
    :func:`up_to_date` (nothing to do), :func:`select_conversations` (read, normalise, dedupe, sample, the
    self-instruct prompts on top, limit), :func:`_regenerate` (when ``prompts.regenerate``), :func:`build_report`,
    :func:`write_outputs`.

    Args:
        cfg: run config; ``cfg.prompts`` holds the settings.
        source, fmt, regenerate: override ``prompts.source``/``format``/``regenerate``.
        limit: keep only the first ``limit`` conversations after sampling (quick runs).
        force: recompute even when the outputs are up to date (the self-instruct file too).

    Returns:
        0 (the CLI exit status).

    Raises:
        UserError: bad input (see :func:`eagle3.prompts.readers.read_conversations`), nothing left to
            write, or a verifier that cannot be loaded. No output is written in that case.
    """
    cfg = apply_overrides(cfg, source, fmt, regenerate, limit)
    if not _replicated(cfg) and not _rank0():
        return 0  # under torchrun only the in-process regeneration has work for every rank: rank 0 does the rest
    from eagle3.process_group import process_group_scope
    from eagle3.prompts.replicas import Dist, init_dist

    # under torchrun with the replicas: their gloo group, made here so the ranks can agree on the up-to-date check
    # (:func:`ranks_agree`) and wait for rank 0's self-instruct file; without them rank 0 works alone (no group: a
    # peer that returned would not join, or would wait at its teardown barrier)
    d = init_dist() if _replicated(cfg) else Dist()
    with process_group_scope(
        owned=d.initialized_here
    ):  # regenerate_replicas uses it and leaves its teardown here
        if cfg.prompts.self_instruct is not None:
            make_self_instruct(cfg, force, d)
        return _run(cfg, source, fmt, regenerate, limit, force, d)


def ranks_agree(cfg: RunConfig, d, want: dict, fresh: bool) -> bool:
    """The torchrun ranks' one up-to-date decision (``fresh``), once every rank is known to want the same settings.

    Each rank reads the config and the ``prompts.source`` files itself; a rank that read other ones (a node with
    another copy of a file) regenerated its share for other input, refused only at the merge, after the whole
    regeneration; and a rank 0 that found ``prompts.jsonl`` up to date returned while a rank that did not waited for
    it in the process group's set-up (3 hours, deaf to SIGTERM). The ranks now compare their settings (the source
    files' sha256 among them) and decisions first.

    Raises:
        UserError: on every rank, naming the first rank whose settings (or decision) differ from rank 0's.
    """
    if d.world <= 1:
        return fresh
    everyone = d.gather((json.dumps(want, sort_keys=True, default=str), fresh))
    for r, (w, f) in enumerate(everyone):
        if w != everyone[0][0]:
            mine, theirs = json.loads(w), json.loads(everyone[0][0])
            keys = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
            raise UserError(
                f"{cfg.prompts_path}: torchrun rank {r} read other 01 settings or prompts.source files "
                f"than rank 0 (differing: {', '.join(keys)}); every rank must read the same config and "
                f"source files (a node with another copy of them?)"
            )
        if f != everyone[0][1]:
            raise UserError(
                f"{cfg.prompts_path}: torchrun rank {r} found {cfg.prompts_path.name} "
                f"{'up to date' if f else 'out of date'}, rank 0 did not; every rank must see the same "
                f"output folder (a node-local output_root?)"
            )
    return fresh


def _replicated(cfg: RunConfig) -> bool:
    """Whether the run's work is shared over torchrun ranks: only the in-process regeneration (one verifier replica
    per rank); endpoints, or no regeneration, run on rank 0 alone."""
    return cfg.prompts.regenerate and cfg.prompts.regenerate_via == "local"


def make_self_instruct(cfg: RunConfig, force: bool, d) -> Path:
    """``prompts.self_instruct``'s file ``{output_root}/self_instruct.jsonl``, made or found up to date
    (:func:`eagle3.prompts.self_instruct.make_from_config`, the code of ``01 --self-instruct``) by rank 0 under the
    writer lock (:func:`writer_lock`: one 01 per output folder); the other torchrun ranks wait at a gather that tells
    them whether rank 0 made it (if not, each stops in one line repeating rank 0's error).

    Args:
        d: :class:`eagle3.prompts.replicas.Dist` (a world of 1 without torchrun).

    Returns:
        The file's path.

    Raises:
        UserError: another 01 writes to the folder, or the self-instruct run's errors (no query kept, ...); on a
            rank > 0: rank 0 failed.
    """
    from eagle3.prompts.self_instruct import make_from_config

    failed = None
    if d.rank == 0:
        try:
            with writer_lock(cfg):
                if (
                    force
                ):  # before the self-instruct file is sampled again: an interrupted run is redone
                    mark_forced(cfg)
                make_from_config(cfg, force)
        except (
            KeyboardInterrupt
        ) as e:  # interrupt_hint would speak of regenerated answers, none yet
            e.hint = (
                f"self-instruct sampling stopped, nothing of it kept ({cfg.self_instruct_path} is written once "
                f"all prompts.self_instruct.num queries are sampled); re-run the same command to sample again"
            )
            raise
        except Exception as e:  # noqa: BLE001 - told to the other ranks, then raised here
            failed = str(e) if isinstance(e, UserError) else f"{type(e).__name__}: {e}"
            d.gather(failed)
            raise
    # every rank reads the file after rank 0 wrote it; the gather is that barrier and says whether rank 0 could: a
    # peer left at a plain barrier by a rank 0 that stopped on an error died in a gloo "Connection closed" traceback
    # (its error is repeated: torchrun may end rank 0 before it prints)
    failed = d.gather(failed)[0] if d.world > 1 else None
    if failed is not None:
        raise UserError(
            f"rank {d.rank}: stopped, rank 0 could not make {cfg.self_instruct_path}: {failed}"
        )
    return cfg.self_instruct_path


def _require_source_files(cfg: RunConfig) -> None:
    """One line for a ``prompts.source`` file that does not exist (named sets and ``hf:`` sources aside), before 01
    says it remakes ``prompts.jsonl`` (the earlier file is kept)."""
    from eagle3.io.read import relative_hint

    src = cfg.prompts.source
    for x in [src] if isinstance(src, str) else list(src):
        if x != "humaneval" and not x.startswith("hf:") and not Path(x).exists():
            hint = relative_hint(x)
            raise UserError(
                f"{x}: prompts file not found (prompts.source{'; ' + hint if hint else ''})"
            )


def _run(
    cfg: RunConfig,
    source: Optional[str],
    fmt: Optional[str],
    regenerate: Optional[bool],
    limit: Optional[int],
    force: bool,
    d,
) -> int:
    """:func:`run` after the overrides (and the self-instruct file): up-to-date check, select, regenerate, write.
    ``source``/``fmt``/``regenerate``: the command line's, recorded as the report's ``cli_overrides``."""
    pc = cfg.prompts
    out, rep = cfg.prompts_path, report_path(cfg)
    source_stats: dict = {}  # each source file's size, mtime and hash: 02 reuses the hash while they hold
    want = settings(cfg, limit, seen=source_stats)
    _, report = read_report(cfg)  # once: the up-to-date check and the reason to remake read it
    forced = forced_path(cfg)
    unfinished = (
        forced.is_file()
    )  # a --force run stopped before writing its outputs: the old ones are not current
    if ranks_agree(cfg, d, want, not force and not unfinished and up_to_date(report, want)):
        if _rank0():  # once under torchrun, as the remaking line
            print(f"prompts up to date: {out} ({rep.name} settings unchanged; use --force to redo)")
            older = older_answers_warning(out, report)
            if older:
                log.warning("%s", older)
        return 0
    _require_source_files(
        cfg
    )  # before the remaking line: it said `remaking ...` and then the file was missing
    why = (
        ("--force" if force else f"a --force run did not finish ({forced.name}): redoing it")
        if out.is_file() and (force or unfinished)
        else redo_reason(out, rep, report, want)
    )
    if why and _rank0():  # say why before a (long) regeneration; once under torchrun
        print(f"remaking {out} ({why})", flush=True)

    if not _rank0() and not _replicated(cfg):
        # under torchrun only the in-process regeneration shares work over the ranks; without it (endpoints, or no
        # regeneration) rank 0 does everything: before, every rank sent every request and wrote prompts.jsonl
        return 0
    convs, counts, kept_by_step = select_conversations(cfg, limit)
    regen_stats: dict = {}
    reused_info: Optional[dict] = None
    with writer_lock(cfg):  # one 01 per output folder (its resume log, prompts.jsonl)
        if (
            force and _rank0()
        ):  # before anything changes: a run stopped from here on is redone by the next
            mark_forced(cfg)
        if pc.regenerate:
            if force:
                partial_path(cfg).unlink(missing_ok=True)
            convs, reused_info = _regenerate_reusing(cfg, convs, want, regen_stats, force)
            if (
                convs is None
            ):  # a torchrun rank > 0: its answers are in its resume log, rank 0 writes the outputs
                return 0
            if not convs:
                raise nothing_regenerated(cfg, regen_stats)
        elif (
            not _rank0()
        ):  # nothing to share out without regeneration: rank 0 writes the outputs (each rank wrote
            return 0  # and printed them, fresh-user trial 2026-12-05f)
        answer_fields = regen_stats.pop(
            "answer_fields", list(ANSWER_FIELDS)
        )  # what every answer records
        report = build_report(cfg, want, counts, kept_by_step, convs, regen_stats, answer_fields)
        if reused_info is not None:
            report["reused_answers"] = reused_info
        # settings the command line set (not the config): 02 does not compare them with its config (prompts_changes)
        report["cli_overrides"] = [
            k
            for k, v in (("source", source), ("format", fmt), ("regenerate", regenerate))
            if v is not None
        ]
        report[SOURCE_STATS] = source_stats
        write_outputs(cfg, convs, report, regen_stats)
    return 0


LOCK_NAME = ".prompts.lock"  # next to prompts.jsonl while a 01 writes there


@contextlib.contextmanager
def writer_lock(cfg: RunConfig):
    """Hold ``{prompts folder}/.prompts.lock`` (:func:`eagle3.io.lock.exclusive_lock`) for the block: a second 01 on the
    same output folder stops at once with ``error: <folder>/.prompts.lock: another 01_prepare_prompts run is writing
    to <folder>`` (before, both regenerated everything, appending to one resume log). Under torchrun only rank 0
    takes it (the job's other ranks write their own logs there). A folder this call created is removed again when
    the block fails and leaves it empty, so a refused run leaves nothing behind."""
    if not _rank0():
        yield
        return
    folder = cfg.prompts_path.parent
    created = not folder.exists()
    make_dirs(folder, cfg.output_field("prompts"))
    try:
        with exclusive_lock(
            folder / LOCK_NAME, f"another 01_prepare_prompts run is writing to {folder}"
        ):
            yield
    except BaseException:
        if created and folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()
        raise


def apply_overrides(
    cfg: RunConfig,
    source: Optional[str],
    fmt: Optional[str],
    regenerate: Optional[bool],
    limit: Optional[int],
) -> RunConfig:
    """``cfg`` with the CLI's ``--source``/``--format``/``--regenerate`` applied and validated.

    Raises:
        UserError: an override the ``prompts`` schema refuses (named ``--<option> (prompts.<field>)``, with the
            value), or ``limit < 1``.
    """
    upd = {
        k: v
        for k, v in (("source", source), ("format", fmt), ("regenerate", regenerate))
        if v is not None
    }
    if upd:
        try:
            prompts_cfg = PromptsConfig.model_validate({**cfg.prompts.model_dump(), **upd})
        except ValidationError as e:
            err = at_item(e.errors()[0], upd)
            key = field_path(err["loc"])
            flag = str(err["loc"][0]) if err["loc"] else ""
            # the flag's own value, else a config field the flag clashes with
            name = f"--{flag} (prompts.{key})" if flag in upd else f"prompts.{key}"
            raise UserError(
                f"{name}: {err['msg'].removeprefix('Value error, ')} (got {err.get('input')!r})"
            ) from e
        cfg = cfg.model_copy(update={"prompts": prompts_cfg})
    if limit is not None and limit < 1:
        raise UserError(f"--limit: must be >= 1, got {limit}")
    return cfg


def _brief(value, limit: Optional[int] = 200) -> str:
    """``repr(value)``, cut to ``limit`` characters (a source hash, a chat template) for one log line (None: whole)."""
    text = repr(value)
    return text if limit is None or len(text) <= limit else text[: limit - 3] + "..."


def _change_lines(key: str, old, want, limit: Optional[int] = 200) -> list[str]:
    """``key: old -> new`` (each cut to ``limit``), or for two mappings (``self_instruct``) one line per changed
    sub-key (:func:`_sub_changes`)."""
    if isinstance(old, dict) and isinstance(want, dict):
        return _sub_changes(key, old, want)
    return [f"{_SETTING_LABELS.get(key, key)}: {_brief(old, limit)} -> {_brief(want, limit)}"]


# settings keys that are no config key of their own: named with where they come from, so a user who changed
# extract.max_length (not prompts.max_context_tokens, which a config rarely sets) finds the edit in the message
_SETTING_LABELS = {
    "max_context_tokens": "max_context_tokens (prompts.max_context_tokens, else extract.max_length)",
    "verifier_weights": "verifier_weights (the weight files at verifier.path)",
}


def redo_reason(out: Path, rep: Path, report: Optional[dict], want: dict) -> Optional[str]:
    """Why an existing ``prompts.jsonl`` is made again: the settings that differ from the ones in
    ``prompts_report.json`` (``rep``, its content ``report`` as :func:`read_report` gives it; ``key: old -> new``,
    every key of :func:`settings`), a missing or unreadable report, or regeneration failures last time. None when
    there is no ``prompts.jsonl`` yet (nothing is replaced) or it is up to date."""
    if not out.is_file():
        return None
    if not rep.is_file():
        return f"no {rep.name} beside it"
    old = report.get("settings") if report is not None else None
    if not isinstance(old, dict):
        return f"{rep.name} has no readable settings"
    old = comparable_settings(old, want)
    keys = [k for k in sorted(set(old) | set(want)) if old.get(k) != want.get(k)]
    if keys:
        parts = source_changes(old, want)  # a file's size and hash follow its name
        for k in (k for k in keys if k not in _SOURCE_KEYS):
            parts += _change_lines(k, old.get(k, "unset"), want.get(k, "unset"))
        return "settings changed: " + "; ".join(parts)
    if _had_failures(report):
        return "conversations failed to regenerate last time: retrying them"
    return None


def _source_files(fp: dict) -> list[dict]:
    """The source fingerprints of a settings mapping: ``[{source, bytes?, sha256?}]`` of one ``source`` or the
    ``sources`` list."""
    if "sources" in fp and isinstance(fp["sources"], list):
        return [x if isinstance(x, dict) else {"source": x} for x in fp["sources"]]
    return [{k: fp[k] for k in ("source", "bytes", "sha256") if k in fp}] if "source" in fp else []


def source_changes(old: dict, want: dict) -> list[str]:
    """How the source files of two settings mappings differ, in the config's words: ``source: 'a.jsonl' -> 'b.jsonl'``
    (a list when either names several) when the names differ, else ``the content of <file> changed`` for each file
    whose size or sha256 differs; [] when they agree. Before, 01's ``remaking`` line and 02's refusal printed the
    whole fingerprints (``bytes: 223 -> 311; sha256: '05e8...' -> 'e310...'``, about 600 characters for two files)."""
    o, w = _source_files(old), _source_files(want)
    if o == w:
        return []
    names_o, names_w = [x.get("source") for x in o], [x.get("source") for x in w]
    if names_o != names_w:

        def one(names):
            return _brief(names[0] if len(names) == 1 else names if names else "unset")

        return [f"source: {one(names_o)} -> {one(names_w)}"]
    return [f"the content of {b.get('source')} changed" for a, b in zip(o, w) if a != b]


def _sub_changes(key: str, old: dict, want: dict) -> list[str]:
    """``key.sub: old -> new`` for each differing sub-key of a mapping setting (``self_instruct``); a file
    fingerprint (``{"source", "bytes", "sha256"}``) whose name is unchanged reads ``the content of <file> changed``."""
    out = []
    for sub in sorted(set(old) | set(want)):
        o, w = old.get(sub, "unset"), want.get(sub, "unset")
        if o == w:
            continue
        if (
            isinstance(o, dict)
            and isinstance(w, dict)
            and "source" in w
            and o.get("source") == w["source"]
        ):
            out.append(f"the content of {w['source']} changed")
        else:
            out.append(f"{key}.{sub}: {_brief(o)} -> {_brief(w)}")
    return out


def nothing_regenerated(cfg: RunConfig, stats: dict) -> UserError:
    """The error for a regeneration that answered no conversation, naming the cause: every conversation's first
    prompt over the context cap (``dropped_over_context``), failed conversations (server path), or both. The
    resume logs then hold no conversation (neither kind is logged): they are removed, so nothing is left behind."""
    from eagle3.prompts.replicas import all_logs

    for p in all_logs(partial_path(cfg).parent):
        p.unlink(missing_ok=True)
    dropped, failed = stats.get("dropped_over_context", 0), stats.get("failed", 0)
    cap = (
        f"{dropped} conversations left out because their first prompt has >= {max_context_tokens(cfg)} tokens "
        f"(prompts.max_context_tokens, else extract.max_length: raise it)"
    )
    if dropped and not failed:
        return UserError(
            f"prompts.max_context_tokens: no conversation to regenerate: {cap}; nothing written"
        )
    where = "prompts.server.urls" if cfg.prompts.regenerate_via != "local" else "prompts.regenerate"
    return UserError(
        f"{where}: every conversation failed to regenerate ({failed} failed; see the error lines above"
        + (f"; {cap}" if dropped else "")
        + "); nothing written"
    )


def up_to_date(report: Optional[dict], want: dict) -> bool:
    """Both outputs exist (``report``: :func:`read_report`'s content, None without ``prompts.jsonl`` or a readable
    report), the report's settings equal ``want`` and no regeneration failed last time."""
    old = report.get("settings") if isinstance(report, dict) else None
    return (
        isinstance(old, dict)
        and comparable_settings(old, want) == want
        and not _had_failures(report)
    )


# 01 settings that come from other sections than ``prompts:`` (a verifier used only to regenerate may differ
# from the one 02 captures with) or from the command line only (``--limit``): not compared by prompts_changes.
# ``max_context_tokens`` is compared: it decides which conversations 01 keeps (``prompts.max_context_tokens``, or
# ``extract.max_length`` when unset)
_NOT_PROMPTS_SECTION = (
    "limit",
    "verifier",
    "verifier_dtype",
    "verifier_weights",
    "chat_template",
    "chat_template_kwargs",
    "reply_start",
    "think_tags",
)
_SOURCE_KEYS = ("source", "sources", "bytes", "sha256")
_REGEN_KEYS = ("max_new_tokens", "regenerate_via", "temperature", "top_p", "model", "extra_body")


def prompts_changes(cfg: RunConfig) -> tuple[Path, list[str]]:
    """The ``prompts:`` settings of ``cfg`` that differ from the ones ``prompts.jsonl`` was made under.

    Compares :func:`settings` of ``cfg`` with ``prompts_report.json``'s (``--limit`` taken from the report).
    Not compared: settings of other sections (:data:`_NOT_PROMPTS_SECTION`), settings 01's command line set
    (the report's ``cli_overrides``; a report written before they were recorded: source, format and
    regenerate) and a source file's size/SHA-256 when the file is no longer there.

    Returns:
        ``(report path, ["key: old -> new", ...])``; the list is empty when nothing differs, or when there
        is no report or no ``prompts.jsonl`` (a prompts file written by hand) or the report has no settings.
    """
    rep, report = read_report(cfg)
    return rep, report_changes(cfg, report)


def _rank0() -> bool:
    """This process is the only one or torchrun's rank 0 (the one that prints and takes the writer lock)."""
    return os.environ.get("RANK", "0") in ("", "0")


def read_report(cfg: RunConfig) -> tuple[Path, Optional[dict]]:
    """``(prompts_report.json's path, its content)``; the content is None when there is no ``prompts.jsonl`` (a prompts
    file written by hand), no report, or one that cannot be read or is not a JSON object (nothing to compare)."""
    out, rep = cfg.prompts_path, report_path(cfg)
    if not (out.is_file() and rep.is_file()):
        return rep, None
    try:
        report = json.loads(rep.read_text(encoding="utf-8"))
    except (
        OSError,
        ValueError,
    ):  # malformed JSON, or bytes that are not UTF-8 (UnicodeDecodeError)
        return rep, None
    return rep, report if isinstance(report, dict) else None


def report_changes(cfg: RunConfig, report: Optional[dict]) -> list[str]:
    """:func:`prompts_changes` against an already read ``prompts_report.json`` content (:func:`read_report`):
    ``["key: old -> new", ...]``, empty when nothing differs or ``report`` is None / has no settings. A source file
    is hashed only when its size or mtime differs from the report's :data:`SOURCE_STATS` (else its hash is reused)."""
    old = report.get("settings") if isinstance(report, dict) else None
    if not isinstance(old, dict):
        return []
    want = settings(
        cfg, old.get("limit"), known=report.get(SOURCE_STATS)
    )  # only a change to detect: a recorded
    # hash is reused while the source's size and mtime are unchanged
    old = comparable_settings(old, want)
    skip = set(_NOT_PROMPTS_SECTION)
    cli = report.get("cli_overrides", ["source", "format", "regenerate"])
    for key in cli if isinstance(cli, list) else []:
        skip.update(_SOURCE_KEYS if key == "source" else (key,))
        if key == "regenerate" and old.get("regenerate") != want.get("regenerate"):
            skip.update(_REGEN_KEYS)
    if "sha256" not in want:  # the source file is gone (or never was one): compare its name only
        old.pop("sha256", None), old.pop("bytes", None)
    si_old, si_want = old.get("self_instruct"), want.get("self_instruct")
    if (
        isinstance(si_old, dict)
        and isinstance(si_want, dict)
        and "sha256" not in si_want.get("file", {})
    ):
        old["self_instruct"] = {
            **si_old,
            "file": si_want["file"],
        }  # the self-instruct file is gone: its settings only
    if isinstance(old.get("sources"), list) and isinstance(want.get("sources"), list):
        old["sources"] = [
            {k: v for k, v in o.items() if k in w or k not in ("sha256", "bytes")}
            if isinstance(o, dict)
            else o
            for o, w in zip(old["sources"], want["sources"])
        ] + old["sources"][len(want["sources"]) :]
    changes = [] if skip & set(_SOURCE_KEYS) else source_changes(old, want)
    for k in sorted((set(old) | set(want)) - skip - set(_SOURCE_KEYS)):
        o, w = old.get(k, "unset"), want.get(k, "unset")
        if o == w:
            continue
        # self_instruct: the changed sub-keys, not both whole mappings with the file's sha256 (02's refusal was ~700
        # characters for self_instruct.num: 8 -> 9); a mapping against no mapping cut to 120 characters
        changes += _change_lines(
            k, o, w, 120 if isinstance(o, dict) or isinstance(w, dict) else None
        )
    return changes


def select_conversations(cfg: RunConfig, limit: Optional[int]) -> tuple[list[dict], Counter, dict]:
    """Read every source (in order), dedupe, sample ``prompts.sample_size`` (seeded) and keep the first ``limit``.

    Returns:
        ``(conversations, counts, steps)``: the reader's counts (``read``, ``skipped_*``, ...) and the
        steps' figures ``normalised``, ``deduped``, ``sampled_out``, ``limited_out``.

    Raises:
        UserError: no usable conversation left (with the reader's counts and a hint for prompt-only sources).
    """
    pc = cfg.prompts
    counts: Counter = Counter()
    sources = [pc.source] if isinstance(pc.source, str) else list(pc.source)
    convs = []
    for (
        src
    ) in sources:  # several sources are concatenated in order, then deduped and sampled together
        convs += read_conversations(
            src,
            pc.format,
            hf_split=pc.hf_split,
            keep_prompt_only=pc.regenerate,
            system_prompt=pc.system_prompt,
            counts=counts,
            think_tags=tuple(cfg.verifier.think_tags),
        )
    convs = unique_ids(convs)  # ids repeated across the sources get #2, #3, as within one file
    n_read_ok = len(convs)
    n_dup = 0
    if pc.dedupe:
        convs, n_dup = dedupe(convs)
    n_before = len(convs)
    short = short_pool_warning(
        "prompts.sample_size",
        pc.sample_size,
        n_before,
        "conversations left after reading" + (" and dedupe" if pc.dedupe else ""),
    )
    if short and _rank0():  # asked for more than there are: say so (once under torchrun)
        log.warning("%s", short)
    convs = sample(convs, pc.sample_size, pc.seed)
    if not convs:
        hint = (
            "; prompt-only sources need prompts.regenerate: true (the verifier writes the answers)"
            if counts.get("skipped_no_assistant") and not pc.regenerate
            else ""
        )
        raise UserError(
            f"prompts.source: no usable conversation in '{pc.source}': {read_counts_text(counts)}{hint}"
        )
    steps = {"normalised": n_read_ok, "deduped": n_dup, "sampled_out": n_before - len(convs)}
    if (
        pc.self_instruct is not None
    ):  # on top of the sampled sources (sample_size counts the sources only)
        convs, steps["self_instruct"], steps["self_instruct_deduped"] = add_self_instruct(
            cfg, convs
        )
    steps["limited_out"] = 0
    if limit is not None and len(convs) > limit:
        steps["limited_out"] = len(convs) - limit
        convs = convs[:limit]
    if pc.self_instruct is not None:  # they come last: --limit cuts them first
        steps["self_instruct_limited_out"] = dropped = min(
            steps["self_instruct"], steps["limited_out"]
        )
        if dropped and _rank0():
            log.warning(
                limit_drops_self_instruct(
                    "--limit",
                    limit,
                    steps["self_instruct"],
                    dropped,
                    len(convs) + steps["limited_out"],
                )
            )
    return convs, counts, steps


def limit_drops_self_instruct(
    flag: str, limit: int, n_self_instruct: int, dropped: int, total: int
) -> str:
    """The one-line warning of a ``limit`` (``flag``: 01's or 02's ``--limit``) that leaves out ``dropped`` of the
    ``n_self_instruct`` ``prompts.self_instruct`` prompts, which come after the sampled sources (``total``
    conversations in all before the limit)."""
    return (
        f"{flag} {limit}: leaves out {dropped} of the {n_self_instruct} prompts.self_instruct prompts (they come "
        f"after the {total - n_self_instruct} sampled source conversations); {flag} {total} keeps them all"
    )


def add_self_instruct(cfg: RunConfig, convs: list[dict]) -> tuple[list[dict], int, int]:
    """``convs`` followed by the prompts of ``cfg.self_instruct_path`` (``prompts.self_instruct``'s file, read as 01
    reads a source: prompt-only, ``prompts.system_prompt`` prepended), those whose dedupe key is already among
    ``convs`` dropped when ``prompts.dedupe`` (the first conversation wins, as for the sources).

    Returns:
        ``(conversations, self-instruct prompts added, self-instruct prompts dropped as duplicates)``.

    Raises:
        UserError: the file is missing or unreadable (:func:`eagle3.prompts.readers.read_conversations`).
    """
    pc = cfg.prompts
    extra = read_conversations(
        str(cfg.self_instruct_path),
        "messages",
        keep_prompt_only=True,
        system_prompt=pc.system_prompt,
        think_tags=tuple(cfg.verifier.think_tags),
    )
    out, n_dup = dedupe(convs + extra) if pc.dedupe else (convs + extra, 0)
    return unique_ids(out), len(extra) - n_dup, n_dup


def build_report(
    cfg: RunConfig,
    want: dict,
    counts: Counter,
    steps: dict,
    convs: list[dict],
    regen_stats: dict,
    answer_fields: Sequence[str] = ANSWER_FIELDS,
) -> dict:
    """``prompts_report.json``'s content: the settings, the counts of every step and the regeneration figures."""
    pc = cfg.prompts
    report = {
        "settings": want,
        "counts": {
            "read": counts["read"],
            "skipped": {
                k[len("skipped_") :]: v
                for k, v in sorted(counts.items())
                if k.startswith("skipped_")
            },
            "dropped_leading_assistant": counts["dropped_leading_assistant"],
            **steps,  # normalised, deduped, sampled_out, [self_instruct, self_instruct_deduped,] limited_out,
            # [self_instruct_limited_out] (this order)
            **(left_out_by_regeneration(regen_stats) if pc.regenerate else {}),
            "kept": len(convs),
            # answered by the verifier (this run, an earlier one's resume log or prompts.reuse_answers); conversations
            # with tool results are kept as they are, not regenerated
            "regenerated": len(convs) - regen_stats.get("kept_with_tools", 0)
            if pc.regenerate
            else 0,
            # assistant replies whose inline <think> block became reasoning_content
            **(
                {"inline_reasoning_split": counts["inline_reasoning_split"]}
                if counts["inline_reasoning_split"]
                else {}
            ),
        },
    }
    if (
        pc.regenerate
    ):  # what every answer records (an up-to-date check names a file written without them)
        report["answer_fields"] = list(answer_fields)
    if regen_stats:
        secs = regen_stats["seconds"]
        report["regeneration"] = {
            **regen_stats,
            "via": pc.regenerate_via,
            "tokens_per_s": regen_stats["new_tokens"] / secs if secs > 0 else None,
        }
        if pc.regenerate_via != "local":
            report["regeneration"]["sampling"] = {
                "max_new_tokens": pc.max_new_tokens,
                "temperature": pc.temperature,
                "top_p": pc.top_p,
                "chat_template_kwargs": dict(cfg.verifier.chat_template_kwargs),
                "extra_body": pc.server.extra_body,
            }
    return report


def older_answers_warning(out: Path, report: Optional[dict]) -> Optional[str]:
    """The one-line warning of an up-to-date ``prompts.jsonl`` whose answers an older 01 regenerated, without every
    field this one records on an answer (:data:`eagle3.prompts.chat.ANSWER_FIELDS`; ``prompts_report.json``'s
    ``answer_fields``, absent before 2026-12-05h): its answers lack ``stop_token`` (and, before 2026-12-05g,
    ``truncated``), so 02 trains the template's end-of-turn token after an answer cut at ``prompts.max_new_tokens``
    or stopped on another stop id as if the verifier had emitted it. None for a file that was not regenerated or
    records them all. Its settings still match, so the file stays up to date (a warning, not a remake)."""
    st = report.get("settings") if isinstance(report, dict) else None
    if (
        not isinstance(st, dict)
        or not st.get("regenerate")
        or report.get("answer_fields") == list(ANSWER_FIELDS)
    ):
        return None
    have = report.get("answer_fields")
    missing = [
        f for f in ANSWER_FIELDS if f != "tokens" and not (isinstance(have, list) and f in have)
    ]
    regen = report.get("regeneration")
    cut = regen.get("truncated") if isinstance(regen, dict) else None
    return (
        f"{out}: regenerated by an older 01 that did not record {' / '.join(missing)} on each answer "
        f"({REPORT_NAME} has {'no answer_fields' if have is None else 'answer_fields ' + json.dumps(have)}"
        f"{f'; {cut} answers were cut at prompts.max_new_tokens' if isinstance(cut, int) and cut else ''}): 02 "
        "trains the template's end-of-turn token after an answer cut at prompts.max_new_tokens or stopped on "
        "another stop id as if the verifier had emitted it; re-run 01 with --force to record them"
    )


def left_out_by_regeneration(regen_stats: dict) -> dict:
    """The conversations the regeneration left out, so that the report's counts add up (``kept`` = ``normalised`` -
    ``deduped`` - ``sampled_out`` [+ ``self_instruct`` - ``self_instruct_deduped``] - ``limited_out`` - these):
    ``dropped_over_context`` (first prompt at or over the context cap) and, through endpoints, ``failed``. Before,
    they were only in ``regeneration``: the counts, the Markdown table and the closing line said 12 read, none
    skipped, deduplicated or limited out, and 10 kept."""
    out = {"dropped_over_context": regen_stats.get("dropped_over_context", 0)}
    if "failed" in regen_stats:
        out["failed"] = regen_stats["failed"]
    return out


def write_outputs(cfg: RunConfig, convs: list[dict], report: dict, regen_stats: dict) -> None:
    """Write ``prompts.jsonl``, the report (JSON + Markdown), drop the resume log when nothing failed, and print."""
    pc = cfg.prompts
    out, rep = cfg.prompts_path, report_path(cfg)
    atomic_write_jsonl(out, convs)
    atomic_write_json(rep, report)
    atomic_write_text(rep.with_suffix(".md"), report_markdown(report))
    forced_path(cfg).unlink(
        missing_ok=True
    )  # a --force run (this one or an interrupted one) has finished
    failed = regen_stats.get("failed", 0)
    if pc.regenerate and not failed:
        from eagle3.prompts.replicas import all_logs

        for p in all_logs(
            partial_path(cfg).parent
        ):  # everything is in the final file now (every replica's log)
            p.unlink(missing_ok=True)
    if failed:
        print(
            f"regeneration: {failed} conversation(s) failed (ids in {rep.name}); they are not in {out.name}. "
            f"Rerun the same command to retry only those."
        )
    c = report["counts"]
    si = report["settings"].get("self_instruct")
    si_text = (
        f", self-instruct {si['num']} sampled / {c['self_instruct'] - c.get('self_instruct_limited_out', 0)} "
        f"kept"
        if isinstance(si, dict) and "self_instruct" in c
        else ""
    )
    reused = report.get(
        "reused_answers"
    )  # regenerated counts them too: say how many came from the earlier file
    reused_text = (
        f", {reused['conversations']} of them reused from {reused['file']}" if reused else ""
    )
    dropped = c.get("dropped_over_context", 0)
    cap_text = (
        f", {dropped} left out by the context cap (prompts.max_context_tokens)" if dropped else ""
    )
    print(
        f"prompts: {out} ({c['kept']} conversations; read {c['read']}, skipped {sum(c['skipped'].values())}, "
        f"deduped {c['deduped']}{cap_text}, regenerated {c['regenerated']}{reused_text}{si_text})"
    )
    print(f"report:  {rep}")
