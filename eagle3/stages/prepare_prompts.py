"""Stage 01: read -> normalise -> dedupe -> sample -> (+ self-instruct prompts) -> (regenerate) -> prompts.jsonl.

Outputs, each written atomically: ``cfg.prompts_path`` (``{"id", "messages"}`` per line), ``prompts_report.json``
(settings: :mod:`eagle3.stages.prompts_manifest`; counts) and ``prompts_report.md`` (:mod:`eagle3.regen.report`). Idempotent:
outputs whose report records this run's settings are up to date (``force=True`` recomputes; a forced run's marker
keeps the old outputs out of date until the new ones are written, for 01 and 02).
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Optional

from pydantic import ValidationError

from eagle3.chat.template import ANSWER_FIELDS, ChatOptions, common_answer_fields, end_of_turn_ids
from eagle3.config import PromptsConfig, RunConfig
from eagle3.errors import UserError
from eagle3.io import exclusive_lock, make_dirs
from eagle3.process_group import Dist, is_rank0, process_group_scope
from eagle3.regen import reuse_answers
from eagle3.regen.engine_choice import engine_options
from eagle3.regen.manifest import SOURCE_STATS, redo_reason, up_to_date
from eagle3.regen.regen_server import regenerate_via_server
from eagle3.regen.replicas import (
    all_logs,
    init_replicas,
    kept_answers_hint,
    ranks_agree,
    regenerate_replicas,
)
from eagle3.regen.report import (
    nothing_regenerated_error,
    older_answers_warning,
    print_outputs,
    write_outputs,
)
from eagle3.regen.resume_log import PARTIAL_NAME, logged_answer_fields
from eagle3.regen.selection import require_source_files, select_conversations
from eagle3.settings.loader import at_item, field_path
from eagle3.stages.prompts_manifest import (
    build_report,
    forced_path,
    mark_forced,
    max_context_tokens,
    read_report,
    report_path,
    settings,
)
from eagle3.stages.self_instruct import make_from_config
from eagle3.verifier import load as verifier_load

log = logging.getLogger(__name__)


def partial_path(cfg: RunConfig) -> Path:
    """The regeneration resume log (either path: endpoints or in-process), next to ``cfg.prompts_path``."""
    return cfg.prompts_path.parent / PARTIAL_NAME


def interrupt_hint(cfg: RunConfig, regenerate: Optional[bool] = None) -> str:
    """What an interrupted 01 kept and how to go on (the line after ``interrupted by SIGTERM:``;
    :func:`eagle3.regen.replicas.kept_answers_hint`). ``regenerate``: the command line's ``--regenerate`` /
    ``--no-regenerate`` (None: ``prompts.regenerate``); a run that does not regenerate keeps nothing (it writes
    ``prompts.jsonl`` at the end), and is told so rather than about regenerated answers."""
    if not (cfg.prompts.regenerate if regenerate is None else regenerate):
        return f"nothing written ({cfg.prompts_path.name} is written at the end); re-run the same command"
    return kept_answers_hint(cfg.prompts_path.parent)


def _regenerate(
    cfg: RunConfig, convs: list[dict], want: dict, stats: dict, force: bool = False
) -> Optional[list[dict]]:
    """Regenerate the answers in-process (``local``, over the torchrun replicas if any: None on ranks > 0)
    or through the configured endpoints."""
    pc, max_context = cfg.prompts, max_context_tokens(cfg)
    opts = ChatOptions.from_verifier(cfg.verifier, cfg.extract.loss_on_reasoning)
    unusable = _via_unusable(pc)
    if unusable is not None:
        raise UserError(unusable)
    if pc.regenerate_via == "local":
        kw = dict(max_new_tokens=pc.max_new_tokens, batch_size=pc.gen_batch_size, opts=opts)
        kw.update(max_context=max_context, schedule=pc.gen_schedule, engine=pc.regen_engine)
        # one process, or one verifier replica per torchrun rank (None on ranks > 0: rank 0 writes)
        return regenerate_replicas(
            cfg.verifier,
            cfg.prompts_path.parent,
            convs,
            want,
            stats,
            force=force,
            regen_kwargs={**kw, "engine_options": engine_options(pc)},
        )
    tok = verifier_load.load_tokenizer(cfg.verifier)
    stats["stop_token_ids"] = sorted(end_of_turn_ids(tok))
    journal = partial_path(cfg)
    return regenerate_via_server(
        convs,
        tok,
        pc,
        opts,
        partial_path=journal,
        settings=want,
        stats=stats,
        max_context=max_context,
    )


def _via_unusable(pc: PromptsConfig) -> Optional[str]:
    """Why ``prompts.regenerate_via`` cannot answer with the ``prompts`` settings ``pc``, as the one-line refusal
    with its fix: sampling (``temperature`` / ``top_p``) on the ``local`` path, which decodes greedily, or the
    endpoints (``sglang`` / ``openai``) without ``prompts.server.urls``. None when it can."""
    if pc.regenerate_via == "local":
        if pc.temperature != 0 or pc.top_p != 1:
            return (
                "prompts.temperature/top_p: the local path decodes greedily; sampling needs "
                "prompts.regenerate_via: sglang or openai"
            )
    elif not pc.server.urls:
        return f"prompts.server.urls: needed for prompts.regenerate_via: {pc.regenerate_via}"
    return None


def _regenerate_reusing(
    cfg: RunConfig, convs: list[dict], want: dict, stats: dict, force: bool
) -> tuple[Optional[list[dict]], Optional[dict]]:
    """:func:`_regenerate`, with ``prompts.reuse_answers`` (:mod:`eagle3.regen.reuse_answers`): the inputs an earlier
    regeneration answered under the same settings take its conversations, only the rest are regenerated, the output
    in input order. Returns ``(conversations or None on a torchrun rank > 0, {"file", "conversations"} or None)``."""
    # the answer fields of what is resumed or reused (an older 01's answers lack stop_token): the report records
    # only the fields every answer of prompts.jsonl has (eagle3.chat.template.common_answer_fields)
    recorded = [] if force else [logged_answer_fields(all_logs(partial_path(cfg).parent))]
    if not cfg.prompts.reuse_answers:
        stats["answer_fields"] = common_answer_fields(list(ANSWER_FIELDS), *recorded)
        return _regenerate(cfg, convs, want, stats, force=force), None
    reused, todo = reuse_answers.split(convs, reuse_answers.load(cfg.prompts.reuse_answers, want))
    info = {"file": str(cfg.prompts.reuse_answers), "conversations": len(convs) - len(todo)}
    if info["conversations"]:
        recorded.append(reuse_answers.recorded_fields(cfg.prompts.reuse_answers))
    stats["answer_fields"] = common_answer_fields(list(ANSWER_FIELDS), *recorded)
    if is_rank0():  # once under torchrun
        print(
            f"prompts.reuse_answers: {info['conversations']} of {len(convs)} conversations answered in "
            f"{cfg.prompts.reuse_answers}; regenerating {len(todo)}"
        )
    # nothing left to regenerate: rank 0 writes the outputs, a torchrun rank > 0 returns None as after a regeneration
    done = (
        _regenerate(cfg, todo, want, stats, force=force) if todo else ([] if is_rank0() else None)
    )
    return (None if done is None else reuse_answers.merge(convs, reused, done)), info


def run(
    cfg: RunConfig,
    source: Optional[str] = None,
    fmt: Optional[str] = None,
    regenerate: Optional[bool] = None,
    limit: Optional[int] = None,
    force: bool = False,
) -> int:
    """Run stage 01 and print where the outputs are; returns 0 (the CLI exit status).

    Steps: :func:`apply_overrides` (``source``, ``fmt``, ``regenerate``: the command line's overrides of
    ``prompts.source`` / ``format`` / ``regenerate``; ``limit``: keep the first ``limit`` conversations); with
    ``prompts.self_instruct`` its file first (:func:`make_self_instruct`); the up-to-date check; the selection
    (:func:`eagle3.regen.selection.select_conversations`); the regeneration; the report and the outputs.
    ``force`` recomputes up-to-date outputs (the self-instruct file too).

    Raises:
        UserError: bad input, nothing left to write, or a verifier that cannot be loaded; nothing is written then.
    """
    cfg = apply_overrides(cfg, source, fmt, regenerate)
    if not _replicated(cfg) and not is_rank0():
        return 0  # under torchrun only the in-process regeneration has work for every rank: rank 0 does the rest
    # under torchrun with the replicas: their gloo group, made here so the ranks can agree on the up-to-date check
    # (:func:`ranks_agree`) and wait for rank 0's self-instruct file; without them rank 0 works alone (no group: a
    # peer that returned would not join, or would wait at its teardown barrier)
    d = init_replicas() if _replicated(cfg) else Dist()
    # regenerate_replicas uses the group and leaves its teardown here
    with process_group_scope(owned=d.initialized_here):
        if cfg.prompts.self_instruct is not None:
            make_self_instruct(cfg, force, d)
        return _run(cfg, source, fmt, regenerate, limit, force, d)


def _replicated(cfg: RunConfig) -> bool:
    """Whether the run's work is shared over torchrun ranks: only the in-process regeneration (one verifier replica
    per rank); endpoints, or no regeneration, run on rank 0 alone."""
    return cfg.prompts.regenerate and cfg.prompts.regenerate_via == "local"


def make_self_instruct(cfg: RunConfig, force: bool, d) -> Path:
    """``prompts.self_instruct``'s file (returned), made or found up to date by rank 0 under :func:`writer_lock`
    (:func:`eagle3.stages.self_instruct.make_from_config`); the other ranks of ``d`` (:class:`eagle3.process_group.Dist`)
    wait at a gather that says whether rank 0 made it.

    Raises:
        UserError: another 01 writes to the folder, the self-instruct run's errors; on a rank > 0: rank 0 failed.
    """
    failed = None
    if d.rank == 0:
        try:
            with writer_lock(cfg):
                if force:  # before the file is sampled again: an interrupted run is redone
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
            d.all_gather(failed)
            raise
    # every rank reads the file after rank 0 wrote it: the gather is that barrier, and the ranks go on only when
    # they agree with rank 0's outcome (no failure); a failed rank 0 gathered its error above
    d.agree(
        None,
        lambda _r, failed, _mine: (
            f"rank {d.rank}: stopped, rank 0 could not make {cfg.self_instruct_path}: {failed}"
        ),
    )
    return cfg.self_instruct_path


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
    source_stats: dict = {}  # each source file's size, mtime and hash: 02 reuses the hash while they hold
    want = settings(cfg, limit, seen=source_stats)
    if _current(cfg, d, want, force):
        return 0
    if not is_rank0() and not _replicated(cfg):
        # under torchrun only the in-process regeneration shares work over the ranks; without it (endpoints, or no
        # regeneration) rank 0 does everything
        return 0
    convs, counts, steps = select_conversations(
        cfg.prompts, cfg.verifier.think_tags, cfg.self_instruct_path, limit
    )
    with writer_lock(cfg):  # one 01 per output folder (its resume log, prompts.jsonl)
        # before anything changes: a run stopped from here on is redone by the next
        if force and is_rank0():
            mark_forced(cfg)
        convs, regen_stats, reused_info = _answers(cfg, convs, want, force)
        # a torchrun rank > 0: its answers are in its resume log, rank 0 writes the outputs
        if convs is None:
            return 0
        # what every answer records
        answer_fields = regen_stats.pop("answer_fields", list(ANSWER_FIELDS))
        report = build_report(cfg, want, counts, steps, convs, regen_stats, answer_fields)
        if reused_info is not None:
            report["reused_answers"] = reused_info
        # settings the command line set (not the config): 02 does not compare them with its config (require_current)
        cli = (("source", source), ("format", fmt), ("regenerate", regenerate))
        report["cli_overrides"] = [k for k, v in cli if v is not None]
        report[SOURCE_STATS] = source_stats
        _write_outputs(cfg, convs, report, regen_stats)
    return 0


def _current(cfg: RunConfig, d, want: dict, force: bool) -> bool:
    """Whether the outputs are up to date (every torchrun rank agreeing, :func:`ranks_agree`; said once); else the
    sources are checked and the reason to remake is printed (rank 0)."""
    out, rep = cfg.prompts_path, report_path(cfg)
    _, report = read_report(cfg)  # once: the up-to-date check and the reason to remake read it
    forced = forced_path(cfg)
    # a --force run stopped before writing its outputs: the old ones are not current
    unfinished = forced.is_file()
    if ranks_agree(d, want, not force and not unfinished and up_to_date(report, want), out):
        if is_rank0():  # once under torchrun, as the remaking line
            print(f"prompts up to date: {out} ({rep.name} settings unchanged; use --force to redo)")
            older = older_answers_warning(out, report)
            if older:
                log.warning("%s", older)
        return True
    # before the remaking line: it said `remaking ...` and then the file was missing
    require_source_files(cfg.prompts.source)
    why = (
        ("--force" if force else f"a --force run did not finish ({forced.name}): redoing it")
        if out.is_file() and (force or unfinished)
        else redo_reason(out, rep, report, want)
    )
    if why and is_rank0():  # say why before a (long) regeneration; once under torchrun
        print(f"remaking {out} ({why})", flush=True)
    return False


def _answers(
    cfg: RunConfig, convs: list[dict], want: dict, force: bool
) -> tuple[Optional[list[dict]], dict, Optional[dict]]:
    """``(conversations, regeneration figures, reused-answers info)``: the selected conversations, regenerated when
    ``prompts.regenerate``; conversations None on a torchrun rank > 0 (rank 0 writes the outputs).

    Raises:
        UserError: no conversation was answered (:func:`nothing_regenerated`)."""
    stats: dict = {}
    if not cfg.prompts.regenerate:
        return (convs if is_rank0() else None), stats, None
    if force:
        partial_path(cfg).unlink(missing_ok=True)
    convs, reused_info = _regenerate_reusing(cfg, convs, want, stats, force)
    if convs is not None and not convs:
        raise nothing_regenerated(cfg, stats)
    return convs, stats, reused_info


LOCK_NAME = ".prompts.lock"  # next to prompts.jsonl while a 01 writes there


@contextlib.contextmanager
def writer_lock(cfg: RunConfig):
    """Hold ``{prompts folder}/.prompts.lock`` (:func:`eagle3.io.exclusive_lock`) for the block: a second 01 on the
    same output folder stops at once with ``error: <folder>/.prompts.lock: another 01_prepare_prompts run is writing
    to <folder>`` (before, both regenerated everything, appending to one resume log). Under torchrun only rank 0
    takes it (the job's other ranks write their own logs there). A folder this call created is removed again when
    the block fails and leaves it empty, so a refused run leaves nothing behind."""
    if not is_rank0():
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
) -> RunConfig:
    """``cfg`` with the CLI's ``--source``/``--format``/``--regenerate`` applied and validated.

    Raises:
        UserError: an override the ``prompts`` schema refuses (named ``--<option> (prompts.<field>)``, with the
            value). ``--limit`` is checked by 01's argument type (``positive_int``).
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
    return cfg


def nothing_regenerated(cfg: RunConfig, stats: dict) -> UserError:
    """The error for a regeneration that answered no conversation (:func:`eagle3.regen.report.nothing_regenerated_error`).
    The resume logs then hold no conversation (neither cause is logged): they are removed, so nothing is left behind."""
    for p in all_logs(partial_path(cfg).parent):
        p.unlink(missing_ok=True)
    return nothing_regenerated_error(stats, max_context_tokens(cfg), cfg.prompts.regenerate_via)


def _write_outputs(cfg: RunConfig, convs: list[dict], report: dict, regen_stats: dict) -> None:
    """Write ``prompts.jsonl`` and the report (:func:`eagle3.regen.report.write_outputs`), remove the forced-run
    marker and, when nothing failed, the resume logs (every replica's), and print where the outputs are."""
    out, rep = cfg.prompts_path, report_path(cfg)
    write_outputs(out, rep, convs, report)
    # a --force run (this one or an interrupted one) has finished
    forced_path(cfg).unlink(missing_ok=True)
    failed = regen_stats.get("failed", 0)
    if cfg.prompts.regenerate and not failed:
        for p in all_logs(partial_path(cfg).parent):  # everything is in the final file now
            p.unlink(missing_ok=True)
    print_outputs(out, rep, report, failed)
