"""Stage 05: benchmark an exported EAGLE-3 drafter against its verifier.

Offline (:func:`run`): greedy vs chain speculative decoding of each set in one run, every emitted token checked
against greedy's (:mod:`eagle3.decoding.offline`); on CPU (float32) a difference beyond ``benchmark.tie_tolerance``
fails the run after the reports (``bench.json``, ``bench.md``, ``acceptance.png``) are written. At
``benchmark.temperature`` > 0: both decoders sample, lossless in distribution (:mod:`eagle3.decoding.sampling`). Server
(:func:`run_server`): a running SGLang or vLLM server's tau and speedup (:mod:`eagle3.decoding.server`). Both hold
``{bench_dir}/.bench.lock`` and refuse an unwritable bench folder before any work.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from eagle3.chat.template import ChatOptions, end_of_turn_ids, prompt_ids
from eagle3.config import RunConfig
from eagle3.data import context_prompts, eval_prompts
from eagle3.decoding import checks, drafter_folder
from eagle3.decoding.metrics import add_context_buckets, check_measurement, default_tie_tolerance
from eagle3.decoding.offline import bench_prompts, check_context, effective_batch_size, warm_up
from eagle3.decoding.report import headline, write_reports
from eagle3.decoding.server import report_dirs, run_server_bench, stale_server_reports
from eagle3.decoding.server_checks import check_servers
from eagle3.engines.layers import check_aux_layers, default_aux_layers
from eagle3.errors import UserError
from eagle3.export.reader import preflight_export
from eagle3.io import output_folder_lock, probe_dirs, read_json, rerun_hint
from eagle3.shards.checks import check_extract_settings
from eagle3.verifier import load as vf

log = logging.getLogger(__name__)

BENCH_LOCK = ".bench.lock"  # in bench_dir while a 05 benchmarks into it (one 05 per bench folder)
#: 05's disk-full advice (:func:`eagle3.io.rerun_hint`): a benchmark keeps no partial state to resume from.
REDO_HINT = "re-run the same command (05 does not resume: it benchmarks every set again)"


def holds_bench_lock(fn):
    """Run the stage-05 entry point ``fn(cfg, ...)`` holding ``{bench_dir}/.bench.lock`` (a second 05 on the folder
    stops at once with one line); a full disk meanwhile says to re-run (:data:`REDO_HINT`), not to resume."""

    @functools.wraps(fn)
    def locked(cfg, *args, **kwargs):
        holder = (
            f"another 05_benchmark run is benchmarking into {cfg.bench_dir} (its reports would replace this "
            f"one's, and two runs side by side measure each other's load); wait for it, or set "
            f"benchmark.output_dir"
        )
        with (
            rerun_hint(REDO_HINT),
            output_folder_lock(cfg.bench_dir, BENCH_LOCK, holder, cfg.output_field("bench")),
        ):
            return fn(cfg, *args, **kwargs)

    return locked


# ---- offline -----------------------------------------------------------------------------------------------------
@holds_bench_lock
def run(
    cfg: RunConfig,
    drafter_dir: Optional[str] = None,
    datasets: Optional[Sequence[str]] = None,
    steps: Optional[int] = None,
    num_prompts: Optional[int] = None,
    max_new_tokens: Optional[int] = None,
    serve_aux_layers: Optional[Sequence[int]] = None,
    batch_size: Optional[int] = None,
    tie_tolerance: Optional[float] = None,
) -> int:
    """Stage 05 (offline): check the export, load verifier + drafter, benchmark (:func:`run_offline`); returns 0.

    ``serve_aux_layers`` (HF indices) replaces the aux layers the drafter was trained on (an ablation, warned about).
    On CPU the models run in float32 (lossless check strict); on GPU in ``verifier.dtype``. Each other argument
    overrides its ``benchmark.*`` key.

    Raises:
        UserError: missing drafter folder or metadata, unloadable verifier, bad prompts, lossless failure.
    """
    bc = cfg.benchmark
    steps, steps_field = (steps, "--steps") if steps else (bc.steps, "benchmark.steps")
    max_new_tokens = max_new_tokens or bc.max_new_tokens
    eval_prompts.check_dataset_names(
        datasets or bc.datasets, "--datasets" if datasets else "benchmark.datasets", not datasets
    )
    datasets = list(datasets or bc.datasets)
    probe_dirs(cfg.bench_dir, cfg.output_field("bench"))  # the reports come at the end
    drafter_dir = resolve_drafter_dir(cfg, drafter_dir)
    # a bad set fails before the verifier loads; its notes (too few prompts, categories left out) are said now
    sets, notes = eval_prompts.load_sets(datasets, num_prompts or bc.num_prompts, bc.prompt_pick)
    for w in notes:
        log.warning("%s", w)
    preflight_export(drafter_dir)  # before the verifier loads; load_exported logs its warnings
    more, not_checked = check_before_load(cfg, drafter_dir, steps, steps_field)  # each logged
    verifier, tokenizer, device = _load_verifier(cfg.verifier)
    more_sets, capped = context_set(cfg, tokenizer, verifier.config, steps, max_new_tokens, sets)
    sets, notes = [*sets, *more_sets], [*notes, *capped]
    drafter, aux, warnings, unchecked = load_checked_drafter(
        cfg, drafter_dir, verifier, tokenizer, device, serve_aux_layers
    )
    strict = next(verifier.parameters()).dtype == torch.float32
    models = (verifier, tokenizer, drafter, aux)
    run_offline(
        cfg, models, sets, steps, max_new_tokens, strict, str(drafter_dir), warnings,
        batch_size, tie_tolerance, notes + more, not_checked + unchecked,
    )  # fmt: skip
    return 0


def context_set(cfg: RunConfig, tokenizer, verifier_config, steps: int, max_new_tokens: int, sets):
    """``benchmark.context_lengths``' set, sized with the verifier's template and context, labelled apart from
    ``sets``, and its warnings (logged here): ``([(label, prompts)], lines)``; ``([], [])`` when unset
    (:mod:`eagle3.data.context_prompts`)."""
    if not cfg.benchmark.context_lengths:
        return [], []
    chat = ChatOptions.from_verifier(cfg.verifier, cfg.extract.loss_on_reasoning)
    built, lines = context_prompts.context_set(
        cfg.benchmark.context_lengths, cfg.benchmark.context_prompts,
        lambda m: len(prompt_ids(tokenizer, m, chat)), _max_positions(verifier_config), max_new_tokens, steps,
        [label for label, _ in sets],
    )  # fmt: skip
    for w in lines:
        log.warning("%s", w)
    return [built], lines


def _max_positions(verifier_config) -> Optional[int]:
    return getattr(verifier_config, "max_position_embeddings", None)


def _load_verifier(vcfg) -> tuple[Any, Any, torch.device]:
    """The configured verifier and its tokenizer on ``verifier.device``, in float32 on the CPU (so that the lossless
    check is exact): ``(verifier, tokenizer, device)``."""
    device = vf.resolve_device(vcfg.device)
    if device.type == "cpu" and vcfg.dtype != "float32":
        log.info(
            "CPU run: using float32 instead of %s so that the lossless check is exact", vcfg.dtype
        )
        vcfg = vcfg.model_copy(update={"dtype": "float32"})
    return *vf.load_verifier(vcfg, device), device


def resolve_drafter_dir(cfg: RunConfig, drafter_dir: Optional[str | Path]) -> Path:
    """The drafter folder stage 05 benchmarks: ``--drafter`` when given, else the config's ``export_dir``
    (:func:`eagle3.decoding.drafter_folder.export_folder`).

    Raises:
        UserError: the folder is missing or no export; the message names where it came from.
    """
    if drafter_dir:
        return drafter_folder.export_folder(Path(drafter_dir))
    path = Path(cfg.export_dir)
    return drafter_folder.export_folder(
        path,
        lambda: drafter_folder.missing_export_advice(
            path, cfg.train_dir, cfg.export.engine, cfg.root, cfg.export.output_dir
        ),
    )


def check_before_load(
    cfg: RunConfig, drafter_dir: Path, steps: int, steps_field: str
) -> tuple[list[str], list[str]]:
    """The checks that need no verifier: config ``extract`` settings against the shards' ``data_config.json``
    (refused when they differ), ``steps`` against the trained ``ttt_length`` (warned).

    Returns:
        ``(lines, not_checked)``: every warning line (each logged here), and those that say a check was not made.
    """
    if (cfg.shards_dir / checks.DATA_CONFIG).is_file():
        check_extract_settings(
            cfg.extract, read_json(cfg.shards_dir / checks.DATA_CONFIG), cfg.shards_dir
        )
    ttt_warning, ttt_unchecked = checks.ttt_length_check(drafter_dir, steps, steps_field)
    lines = [
        ttt_unchecked,
        checks.shards_unchecked(cfg.shards_dir, drafter_dir, cfg.extract.model_fields_set),
    ]
    not_checked = [w for w in lines if w]
    warned = [ttt_warning] + not_checked
    for w in warned:
        if w:
            log.warning("%s", w)
    return [w for w in warned if w], not_checked


def load_checked_drafter(
    cfg: RunConfig,
    drafter_dir: Path,
    verifier,
    tokenizer,
    device,
    serve_aux_layers: Optional[Sequence[int]] = None,
) -> tuple[Any, list[int], list[str], list[str]]:
    """Load the exported drafter beside a loaded verifier with every check 05 makes once the verifier is there
    (recorded verifier, aux layers, export folder, vocab map, shape, chat template). Not logged here.

    Returns:
        ``(drafter, aux_layers, warnings, not_checked)``; ``not_checked`` are the lines of ``warnings`` that say a
        check was not made for want of metadata.

    Raises:
        UserError: an aux layer past the verifier's layers, a bad ``serve_aux_layers``, a drafter that does not load
            or contradicts the run's own vocab map or shape.
    """
    dims = vf.verifier_dims(verifier.config)
    fallback = cfg.extract.aux_layers
    if fallback is None:
        try:
            fallback = default_aux_layers(dims["num_layers"])
        except UserError:  # too few layers for the default: the drafter's metadata must say
            fallback = None
    name, fp = cfg.verifier.display_name(), vf.weights_fingerprint(cfg.verifier)
    mismatch, verifier_unchecked = checks.verifier_check(drafter_dir, name, dims, fp)
    with checks.verifier_named_first(mismatch):  # another verifier: the cause before its symptom
        aux, warnings = checks.resolve_aux_layers(drafter_dir, cfg.shards_dir, fallback)
        warnings += [mismatch] if mismatch else []
        warnings += checks.export_folder_warnings(drafter_dir, aux, dims["architecture"])
        meta_field = f"{drafter_dir / checks.TRAIN_META}: aux_layers"
        aux = check_aux_layers(aux, dims["num_layers"], field=meta_field)
        if serve_aux_layers is not None and list(serve_aux_layers) != list(aux):
            serve = check_aux_layers(
                serve_aux_layers, dims["num_layers"], field="--serve-aux-layers"
            )
            warnings.append(
                f"serving with aux layers {serve} although the drafter was trained on {aux} "
                "(--serve-aux-layers)"
            )
            aux = serve
        dtype = next(verifier.parameters()).dtype
        drafter = drafter_folder.load_drafter(drafter_dir, verifier, device, dtype)
    own = drafter_dir == cfg.export_dir
    warnings += checks.check_drafter_vocab(
        drafter, drafter_dir, cfg.data.draft_vocab_size, cfg.data_dir, own_export=own
    )
    warnings += checks.check_drafter_shape(cfg.drafter, drafter, drafter_dir, own_export=own)
    vocab_unchecked = checks.vocab_map_unchecked(cfg.data_dir, drafter_dir, drafter)
    late, unchecked = _after_load(cfg, [verifier_unchecked, vocab_unchecked], tokenizer)
    return drafter, aux, warnings + late, unchecked


def _after_load(
    cfg: RunConfig, unchecked: list[Optional[str]], tokenizer
) -> tuple[list[str], list[str]]:
    """The chat template and its kwargs against the shards', and which checks could not be made (``unchecked``: the
    drafter's verifier record and ``d2t``; then the template's): ``(lines, not_checked)``."""
    chat = ChatOptions.from_verifier(cfg.verifier, cfg.extract.loss_on_reasoning)
    other_template, template_unchecked = checks.template_check(cfg.shards_dir, tokenizer, chat)
    other_kwargs, kwargs_unchecked = checks.template_kwargs_check(
        cfg.shards_dir, cfg.verifier.chat_template_kwargs
    )
    unchecked = [w for w in (*unchecked, template_unchecked, kwargs_unchecked) if w]
    return [w for w in (other_template, other_kwargs) if w] + unchecked, unchecked


def run_offline(
    cfg: RunConfig,
    models: tuple,
    sets: Sequence[tuple[str, list[eval_prompts.EvalPrompt]]],
    steps: int,
    max_new_tokens: int,
    strict: bool,
    drafter_name: str = "",
    warnings: Sequence[str] = (),
    batch_size: Optional[int] = None,
    tie_tolerance: Optional[float] = None,
    logged: Sequence[str] = (),
    not_checked: Sequence[str] = (),
) -> dict:
    """Benchmark loaded ``models`` (``(verifier, tokenizer, drafter, aux_layers)``) on ``sets`` (``(label, prompts)``),
    write the reports, enforce losslessness; returns the ``bench.json`` report dict.

    ``batch_size`` / ``tie_tolerance`` default to ``cfg.benchmark`` (tolerance None: the dtype's
    :func:`~eagle3.decoding.metrics.default_tie_tolerance`). ``warnings`` are recorded and logged at the end;
    ``logged`` (lines said already) are recorded after them, not logged again; ``not_checked`` also as ``not_checked``.

    Raises:
        UserError: (``strict``) output differing from greedy beyond the tie tolerance, after the reports are written.
    """
    verifier, tokenizer, _, aux_layers = models
    eos = sorted(end_of_turn_ids(tokenizer))
    param = next(verifier.parameters())
    bc = cfg.benchmark
    batch_size = batch_size or bc.batch_size
    if tie_tolerance is None:
        tie_tolerance = bc.tie_tolerance
    if tie_tolerance is None:
        tie_tolerance = default_tie_tolerance(param.dtype)
    largest = effective_batch_size(batch_size, max(len(p) for _, p in sets))
    report = {
        "verifier": cfg.verifier.display_name(),
        "drafter": drafter_name,
        "device": str(param.device),
        "dtype": str(param.dtype).replace("torch.", ""),
        "steps": steps,
        "max_new_tokens": max_new_tokens,
        "batch_size": largest,  # effective: the largest batch any set decodes (each set records its own)
        "tie_tolerance": tie_tolerance,
        "aux_layers": list(aux_layers),
        "eos_ids": eos,
        "prompt_pick": bc.prompt_pick,
        **bc.model_dump(
            include={"temperature", "top_p", "rejection_sample_method"}
        ),  # T > 0: sampled
        "warnings": list(warnings) + list(logged),
        "not_checked": list(not_checked),
        "datasets": [],
    }
    settings = (steps, max_new_tokens, eos, batch_size, tie_tolerance, largest)
    report["datasets"] = _bench_sets(cfg, models, sets, *settings)
    mp, lengths = _max_positions(verifier.config), bc.context_lengths
    add_context_buckets(report, context_prompts.capped_edges(lengths, mp, max_new_tokens, steps)[0])
    _finish(report, Path(cfg.bench_dir), tie_tolerance, strict, logged)
    return report


def _bench_sets(cfg, models, sets, steps, max_new_tokens, eos, batch_size, tie_tolerance, largest):
    """Render and tokenise every set, refuse a prompt past the verifier's context, warm both decoders up (untimed),
    then benchmark each set (:func:`eagle3.decoding.offline.bench_prompts`): the ``bench.json`` dataset rows."""
    verifier, tokenizer, drafter, aux_layers = models
    chat = ChatOptions.from_verifier(cfg.verifier, cfg.extract.loss_on_reasoning)
    tokenized = [
        (label, [(p.id, prompt_ids(tokenizer, p.messages, chat)) for p in prompts])
        for label, prompts in sets
    ]
    check_context(tokenized, max_new_tokens, steps, verifier.config)  # before any set is decoded
    warm = prompt_ids(tokenizer, [{"role": "user", "content": "Hi"}], chat)
    sampling = cfg.benchmark.model_dump(include={"temperature", "top_p", "rejection_sample_method"})
    warm_up(verifier, drafter, warm, aux_layers, steps, eos, largest, **sampling)
    rows = []
    for label, ids in tokenized:
        row = bench_prompts(
            verifier, drafter, ids, aux_layers, steps, max_new_tokens, eos, label,
            batch_size=batch_size, tie_tolerance=tie_tolerance, decoder=cfg.benchmark.decoder, **sampling,
        )  # fmt: skip
        rows.append({**row, "prompt_ids": [i for i, _ in ids]})  # the prompts prompt_pick chose
    return rows


def _finish(
    report: dict, out: Path, tie_tolerance: float, strict: bool, logged: Sequence[str]
) -> None:
    """Check the measurement, write the reports, log the warnings not said yet, refuse a lossless failure
    (``strict``) and print the headline."""
    msg = check_measurement(report, tie_tolerance, strict)
    write_reports(out, report)
    said = list(logged)
    for w in report["warnings"]:
        if w in said:  # logged at the start already
            said.remove(w)
        else:
            log.warning("%s", w)
    if msg and strict:
        raise UserError(f"{out / 'bench.json'}: lossless check failed: {msg}")
    print(headline(report, out))


# ---- server ------------------------------------------------------------------------------------------------------
@holds_bench_lock
def run_server(
    cfg: RunConfig,
    urls: Sequence[str],
    datasets: Optional[Sequence[str]] = None,
    num_prompts: Optional[int] = None,
    max_new_tokens: Optional[int] = None,
    concurrency: int = 1,
    timeout: float = 600.0,
) -> int:
    """Stage 05 ``--server``: render the prompts with the verifier's tokenizer and benchmark the server(s); returns 0.

    One report per dataset (default: the config's ``benchmark.datasets`` when it sets them, else ``mtbench``):
    ``server_bench.json``/``.md`` in ``cfg.bench_dir`` (``{bench_dir}/server-{label}/`` when several are given).
    Each records ``draft_folder`` and ``served_model`` (:mod:`eagle3.decoding.server_checks`), ``warnings`` (those
    checks', the chat template's against the shards', the prompt subset's, a speedup above tau) and ``not_checked``.

    Raises:
        UserError: tokenizer, prompt set or server problems (see :func:`eagle3.decoding.server.run_server_bench`).
    """
    configured = cfg.benchmark.datasets if "datasets" in cfg.benchmark.model_fields_set else None
    datasets = eval_prompts.server_sets(datasets, configured)
    probe_dirs(Path(cfg.bench_dir), cfg.output_field("bench"))  # reports after the measurement
    max_new_tokens = max_new_tokens or cfg.benchmark.max_new_tokens
    num_prompts = num_prompts or cfg.benchmark.num_prompts
    tok = vf.load_tokenizer(cfg.verifier)
    chat = ChatOptions.from_verifier(cfg.verifier, cfg.extract.loss_on_reasoning)
    notes, checked = check_servers(urls, cfg.verifier, cfg.shards_dir, tok, chat, cfg.export_dir)
    for w in notes:
        log.warning("%s", w)
    labels = eval_prompts.dataset_labels(datasets)
    for w in stale_server_reports(Path(cfg.bench_dir), labels):
        log.warning("%s", w)
    pick = cfg.benchmark.prompt_pick
    for name, label, out in zip(datasets, labels, report_dirs(Path(cfg.bench_dir), labels)):
        prompts, subset = eval_prompts.load_eval_subset(name, num_prompts, pick)
        for w in subset:
            log.warning("%s", w)
        ids = [(p.id, prompt_ids(tok, p.messages, chat)) for p in prompts]
        head = {"prompt_pick": pick, "prompt_ids": [i for i, _ in ids], "warnings": notes + subset}
        extra = {**head, **checked}
        report = run_server_bench(
            urls, ids, max_new_tokens, concurrency, label, timeout, out, extra=extra
        )
        s = report["servers"][0]
        log.info(
            "%s: tau %s, %.1f output tok/s%s",
            label,
            f"{s['tau']:.2f}" if s.get("tau") else "n/a",
            s["output_tokens_per_s"],
            f", speedup {report['speedup']:.2f}x" if "speedup" in report else "",
        )
        print(f"report: {Path(out) / 'server_bench.md'}")  # as the offline headline ends
    return 0
