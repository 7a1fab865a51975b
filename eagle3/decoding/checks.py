"""05's checks of an exported drafter against the run it is benchmarked in, each taking plain arguments: its
``eagle3_train.json`` (read as :class:`eagle3.manifest.DrafterManifest`: recorded verifier, aux layers, trained
``ttt_length``), the export folder's engine block, its vocab map and shape, and the chat template and its kwargs
against the shards'. A ``*_check`` returns ``(warning, not_checked)``: the line saying something differs, the line
saying a check could not be made for want of metadata; ``*_unchecked`` only the latter."""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from typing import Collection, Optional, Sequence

import torch

from eagle3.chat.template import ChatOptions, chat_template_hash, template_name
from eagle3.data.vocab import VOCAB_MAP, load_vocab_map
from eagle3.drafter.draft_config import untrained_positions
from eagle3.errors import UserError
from eagle3.export.reader import check_export_folder
from eagle3.io import read_json
from eagle3.manifest import DrafterManifest, ExportVerifier
from eagle3.shards.checks import verifier_dims_differ
from eagle3.shards.format import DATA_CONFIG
from eagle3.verifier.load import weights_differ

log = logging.getLogger(__name__)

TRAIN_META = DrafterManifest.FILE  # the export's eagle3_train.json
NOT_OURS = "not found (a drafter not exported by eagle3-train)"


def resolve_aux_layers(
    drafter_dir: Path, shards_dir: Optional[Path], fallback: Optional[list[int]]
) -> tuple[list[int], list[str]]:
    """The aux layers (HF indices) to feed the drafter, and warnings.

    Priority: the drafter's ``eagle3_train.json`` (:class:`eagle3.manifest.DrafterManifest` ``aux_layers_hf``), then
    the shards' ``data_config.json`` ``aux_layers``, then ``fallback``. A warning when the drafter's and the shards'
    lists differ.

    Raises:
        UserError: no source names the aux layers, or a malformed metadata file (as
            :meth:`eagle3.manifest.Manifest.of_record`).
    """
    meta_path, dc = Path(drafter_dir) / TRAIN_META, Path(shards_dir or "") / DATA_CONFIG
    meta = DrafterManifest.of_folder(drafter_dir)
    drafter_aux = meta.aux_layers_hf if meta else None
    raw = read_json(dc) if shards_dir is not None and dc.is_file() else None
    data_aux = raw.get("aux_layers") if isinstance(raw, dict) else None
    warnings = []
    if drafter_aux is not None and data_aux is not None and drafter_aux != data_aux:
        warnings.append(
            f"aux layers differ: drafter {meta_path} records {drafter_aux} but shards {dc} "
            f"record {data_aux} (HF hidden_states indices); using the drafter's"
        )
    aux = drafter_aux or data_aux or fallback
    if aux is None:
        raise UserError(
            f"{meta_path}: no aux layers recorded (and no data_config.json / extract.aux_layers)"
        )
    return [int(i) for i in aux], warnings


def verifier_check(
    drafter_dir: Path,
    verifier_name: str,
    dims: Optional[dict] = None,
    weights: Optional[str] = None,
    dims_checked: bool = True,
) -> tuple[Optional[str], Optional[str]]:
    """The drafter's recorded verifier (``eagle3_train.json`` ``verifier``) against the run's: its name, the
    dimensions ``dims`` of the loaded verifier (:func:`eagle3.verifier.load.verifier_dims`) and the weights
    fingerprint ``weights`` (:func:`eagle3.verifier.load.weights_fingerprint` of ``verifier.path``).

    Returns:
        ``(warning, not_checked)``: the line naming the first difference, or the line saying which comparison could
        not be made (no ``eagle3_train.json`` or no verifier name in it; no fingerprint on one side); both None when
        every comparison agrees. ``dims_checked`` False (``--server``, which loads no verifier): the not-checked line
        does not claim the dimensions were compared.

    Raises:
        UserError: a malformed ``eagle3_train.json`` (as :meth:`eagle3.manifest.DrafterManifest.of_folder`).
    """
    meta_path = Path(drafter_dir) / TRAIN_META
    meta = DrafterManifest.of_folder(drafter_dir)
    rec = meta.verifier if meta else ExportVerifier()
    exported = f"drafter {meta_path} was exported for verifier '{rec.name or verifier_name}'"
    if rec.name and rec.name != verifier_name:
        return f"{exported}, benchmarking it with '{verifier_name}'", None
    diff = verifier_dims_differ(dims or {}, rec.model_dump())
    if diff:
        return f"{exported} of other dimensions than the model at verifier.path ({diff})", None
    if weights_differ(rec.weights, weights):
        return (
            f"{exported} with other weights than the model at verifier.path (key 'verifier.weights': "
            f"{rec.weights[:19]}... recorded, {weights[:19]}... at verifier.path): tau measures the drafter "
            f"against another model"
        ), None
    if not rec.name:
        why = "names no verifier" if meta else NOT_OURS
        at_load = (
            "; only the embedding and vocab shapes are checked at load" if dims_checked else ""
        )
        return None, (
            f"{meta_path} {why}: 05 did not check that the drafter was trained for the verifier '{verifier_name}' "
            f"(name, dimensions, weights{at_load}); check which verifier its training used"
        )
    if rec.weights and weights:
        return None, None
    side = (
        f"{meta_path} records no verifier.weights (an export of shards captured before weight fingerprints)"
        if not rec.weights
        else "verifier.path holds no weight file on this machine"
    )
    return None, (
        f"{side}: 05 did not check that the drafter was trained on the weights at verifier.path, only the name "
        f"'{rec.name}'{' and dimensions' if dims_checked else ''}; check that verifier.path is the model its "
        f"shards were captured from"
    )


def ttt_length_check(
    drafter_dir: Path,
    steps: int,
    steps_field: str,
    fix: Optional[str] = None,
    unchecked_field: Optional[str] = None,
) -> tuple[Optional[str], Optional[str]]:
    """05's draft tokens a step (``steps``, from ``steps_field``: ``--steps``, ``benchmark.steps``, the server's
    ``speculative_num_steps``) against the ``ttt_length`` the drafter's ``eagle3_train.json`` records.

    Returns:
        ``(warning, not_checked)``: the line when ``steps`` exceeds it (``fix``: how to draft fewer, ``{k}`` = the
        ``ttt_length``, ``{field}`` = ``steps_field``; default ``benchmark with {field} {k}``), or the line saying the
        check could not be made (no file, or no ``ttt_length`` in it; named with ``unchecked_field``, default
        ``steps_field``); both None when ``steps`` is within it.

    Raises:
        UserError: a malformed ``eagle3_train.json`` (as :meth:`eagle3.manifest.DrafterManifest.of_folder`).
    """
    meta_path = Path(drafter_dir) / TRAIN_META
    meta = DrafterManifest.of_folder(drafter_dir)
    k = meta.ttt_length if meta else None
    if k is None:
        why = "records no ttt_length" if meta else NOT_OURS
        return None, (
            f"{meta_path} {why}: 05 did not check {unchecked_field or steps_field} {steps} against the draft "
            f"positions the drafter was trained for; check that its training's TTT length (train.ttt_length, "
            f"SpecForge --ttt-length) is at least {steps}"
        )
    if steps <= k:
        return None, None
    fix = (fix or "benchmark with {field} {k}").format(field=steps_field, k=k)
    return (
        f"{steps_field} {steps} drafts more tokens a step than the drafter was trained for: {meta_path} records "
        f"ttt_length {k} (train.ttt_length); {untrained_positions(k, steps, verb=True)} never trained, so the "
        f"acceptance there is low and tau understates a {k}-step chain: {fix}, or train with train.ttt_length {steps}"
    ), None


def shards_unchecked(
    shards_dir: Path, drafter_dir: Path, extract_set: Collection[str] = ()
) -> Optional[str]:
    """The line saying which of 05's checks against the shards' ``data_config.json`` could not be made because the
    file is gone: the config's
    ``extract.aux_layers`` / ``extract.max_length`` (only keys the config sets, ``extract_set``), the drafter's
    recorded aux layers (:func:`resolve_aux_layers`) and the chat template (:func:`template_check`). None when the
    file exists."""
    dc = Path(shards_dir) / DATA_CONFIG
    if dc.is_file():
        return None
    what = ["the chat template (and verifier.chat_template_kwargs)"] + [
        f"the config's extract.{k}" for k in ("aux_layers", "max_length") if k in extract_set
    ]
    try:
        meta = DrafterManifest.of_folder(drafter_dir)
    except UserError:
        meta = None  # resolve_aux_layers refuses it
    if meta is not None and meta.aux_layers_hf is not None:
        what.append(f"the drafter's aux layers ({meta.where})")
    return (
        f"{dc} not found: 05 did not check {', '.join(what)} against the template, layers and length the shards "
        f"were made with; check them against the data_config.json of the shards the drafter was trained on"
    )


def vocab_map_unchecked(data_dir: Path, drafter_dir: Path, drafter) -> Optional[str]:
    """The line saying :func:`check_drafter_vocab` compared only the draft vocab size: the run's stage-03
    ``vocab_map.pt`` is not there, so the loaded ``drafter``'s ``d2t`` was not compared with it. None when it exists,
    or when the drafter drafts the full vocab (``draft_vocab_size`` = ``target_vocab_size``: its ``d2t`` is the
    identity, absent from a vLLM folder, so there is nothing but the size to compare)."""
    vm = Path(data_dir) / VOCAB_MAP
    if vm.is_file() or drafter.args.draft_vocab_size == drafter.args.target_vocab_size:
        return None
    return (
        f"{vm} not found: 05 did not check {Path(drafter_dir) / 'model.safetensors'} d2t (its draft vocabulary) "
        f"against the run's stage-03 vocab map, only its size against data.draft_vocab_size; run 03 for this "
        f"config, or compare d2t with the vocab_map.pt of the data it was trained on"
    )


def template_check(
    shards_dir: Path, tokenizer, chat: ChatOptions, say_missing: bool = False
) -> tuple[Optional[str], Optional[str]]:
    """The chat template 05 renders the prompts with (``verifier.chat_template``, else ``verifier.path``'s tokenizer's)
    against the one the shards were rendered with (``data_config.json`` ``chat_template_hash``).

    Returns:
        ``(warning, not_checked)``: the line for another template, or the line saying the check could not be made (the
        shards record no hash); both None when the hashes agree, the template is unusable (05's rendering says so), or
        the shards' ``data_config.json`` is gone (offline :func:`shards_unchecked` says that; ``say_missing``, for
        ``--server``: the not-checked line names the missing file).
    """
    dc = Path(shards_dir) / DATA_CONFIG
    try:
        rec = read_json(dc).get("chat_template_hash") if dc.is_file() else False
        now = chat_template_hash(tokenizer, chat.chat_template)
    except (UserError, AttributeError):
        return None, None
    if (rec is False and not say_missing) or rec == now:
        return None, None
    used = template_name(tokenizer, chat)
    if not isinstance(rec, str) or not rec:
        return None, (
            f"{dc} {'not found' if rec is False else 'records no chat_template_hash'}: 05 did not check that "
            f"the prompts it renders with {used} are in the template the drafter's data was rendered with; "
            f"check verifier.chat_template against the template the shards were made with"
        )
    return (
        f"{dc}: the shards were rendered with chat template sha256 {rec[:12]} (chat_template_hash) but 05 renders "
        f"the prompts with {used}: the drafter was trained on conversations rendered otherwise, so tau "
        f"understates it; set verifier.chat_template back to the shards' template, or re-run 02-04 with this "
        f"one"
    ), None


def template_kwargs_check(shards_dir: Path, kwargs: dict) -> tuple[Optional[str], Optional[str]]:
    """The ``verifier.chat_template_kwargs`` 05 renders the prompts with (e.g. ``{thinking: false}``) against those
    the shards were rendered with (``data_config.json`` ``chat_template_kwargs``).

    Returns:
        ``(warning, not_checked)``: the line for other kwargs, or the line saying the check could not be made (the
        shards record none); both None when they agree or the shards' ``data_config.json`` is gone or unreadable
        (:func:`shards_unchecked` / :func:`template_check` say that).
    """
    dc = Path(shards_dir) / DATA_CONFIG
    now = dict(kwargs)
    try:
        meta = read_json(dc) if dc.is_file() else None
    except UserError:
        return None, None
    if not isinstance(meta, dict):
        return None, None
    rec = meta.get("chat_template_kwargs")
    if not isinstance(rec, dict):
        return None, (
            f"{dc} records no chat_template_kwargs: 05 did not check that the verifier.chat_template_kwargs "
            f"it renders the prompts with ({now}) are those the drafter's data was rendered with (e.g. "
            f"thinking on or off); check them against the settings the shards were made with"
        )
    if json.dumps(rec, sort_keys=True, default=str) == json.dumps(now, sort_keys=True, default=str):
        return None, None
    return (
        f"{dc}: the shards were rendered with chat_template_kwargs {rec} but 05 renders the prompts with "
        f"verifier.chat_template_kwargs {now}: the drafter was trained on conversations rendered otherwise (e.g. "
        f"thinking on or off), so tau understates it; set verifier.chat_template_kwargs back to the shards' value, "
        f"or re-run 02-04 with this one"
    ), None


@contextlib.contextmanager
def verifier_named_first(mismatch: Optional[str]):
    """Around 05's checks of the drafter against the loaded verifier: when ``mismatch`` (:func:`verifier_check`)
    says the drafter was exported for another verifier, a UserError of the block (an aux layer out of range, an
    embedding that does not fit) is re-raised with the mismatch first, the cause before its symptom.

    Raises:
        UserError: ``<mismatch> (verifier.name / verifier.path): <the original message>``.
    """
    try:
        yield
    except UserError as e:
        if not mismatch:
            raise
        raise UserError(f"{mismatch} (verifier.name / verifier.path): {e}") from e


def export_folder_warnings(
    drafter_dir: Path, aux_layers: Sequence[int], verifier_architecture: str
) -> list[str]:
    """Warnings when the exported folder's ``config.json`` makes its engine capture other verifier
    layers than ``aux_layers`` (the HF indices this benchmark feeds the drafter).

    Raises:
        UserError: the folder's layer ids contradict its recorded engine / HF layers
            (:func:`eagle3.export.reader.check_export_folder`).
    """
    if not (Path(drafter_dir) / "config.json").is_file():
        return []
    info = check_export_folder(drafter_dir, verifier_architecture=verifier_architecture)
    out = list(info["warnings"])
    if info["aux_layers_hf"] is not None and list(info["aux_layers_hf"]) != list(aux_layers):
        out.append(
            f"{Path(drafter_dir) / 'config.json'}: {info['engine']} would capture HF layers {info['aux_layers_hf']} "
            f"(ids {info['engine_layer_ids']}), this benchmark feeds HF layers {list(aux_layers)}"
        )
    return out


def check_drafter_vocab(
    drafter, drafter_dir: Path, draft_vocab_size: int, data_dir: Path, own_export: bool
) -> list[str]:
    """The benchmarked drafter's draft vocab (its ``d2t``, int64 ``[draft_V]``) against ``data.draft_vocab_size`` and,
    when it exists, stage 03's ``{data_dir}/vocab_map.pt``, by :func:`stale_export`'s rule.

    Returns:
        warning lines (also logged).

    Raises:
        UserError: own export whose draft vocab differs from ``data.draft_vocab_size`` or from
            ``vocab_map.pt``; a malformed ``vocab_map.pt`` (as :func:`eagle3.data.vocab.load_vocab_map`).
    """
    got, want = int(drafter.args.draft_vocab_size), int(draft_vocab_size)
    problem, fix = None, None
    # a plain re-run of 04 into the same train folder is refused (its checkpoints hold the old vocab): name the ways
    # that work
    new_run = "or train a drafter for it with 04_train.py into a new train.output_dir"
    if got != want:
        problem = (
            f"{drafter_dir}: drafter has draft_vocab_size {got} but the config's data.draft_vocab_size is "
            f"{want}"
        )
        fix = f"set data.draft_vocab_size back to {got}, {new_run}"
    else:
        vm_path = Path(data_dir) / VOCAB_MAP
        if vm_path.is_file():
            vm = load_vocab_map(vm_path, target_vocab_size=int(drafter.args.target_vocab_size))
            if not torch.equal(vm["d2t"].to(drafter.d2t.device), drafter.d2t):
                problem = f"{drafter_dir}: drafter's d2t differs from {vm_path} (export from an older stage-03 run?)"
                fix = f"re-run 03_prepare_data.py with the data settings the drafter was trained under, {new_run}"
    return [] if problem is None else stale_export(problem, fix, own_export)


def check_drafter_shape(section, drafter, drafter_dir: Path, own_export: bool) -> list[str]:
    """The benchmarked drafter's shape against the config's ``drafter:`` section (its non-null fields, ``variant``
    and ``num_layers``; ``max_position_embeddings`` excepted) by :func:`stale_export`'s rule.

    Returns:
        warning lines (also logged).

    Raises:
        UserError: the run's own export differs from the config, naming every differing field.
    """
    skip = {"max_position_embeddings", "mla"}
    # MLA fixes these two (eagle3/drafter/mla.py); its sizes compare one by one
    if drafter.args.is_mla:
        skip |= {"num_key_value_heads", "head_dim"}
    want = {k: getattr(section, k) for k in type(section).model_fields if k not in skip}
    if drafter.args.is_mla and getattr(section, "mla", None) is not None:
        want |= {f"mla.{k}": v for k, v in section.mla.model_dump().items()}

    def have(key: str):
        return drafter.args.mla[key[4:]] if key.startswith("mla.") else getattr(drafter.args, key)

    diffs = [
        f"{key} {have(key)!r} but the config's drafter.{key} is {value!r}"
        for key, value in want.items()  # None: copied from the verifier at training, nothing to compare
        if value is not None and have(key) != value
    ]
    if not diffs:
        return []
    return stale_export(
        f"{drafter_dir}: the drafter has " + "; ".join(diffs),
        "set those drafter fields back to the trained values, or train a drafter of this shape with "
        "04_train.py into a new train.output_dir",
        own_export,
    )


def stale_export(problem: str, fix: str, own_export: bool) -> list[str]:
    """05's rule for a benchmarked drafter that differs from the run config (``problem``; ``fix``: how to make them
    agree): the run's own export (no ``--drafter``) is stale and refused; a drafter passed with ``--drafter`` may come
    from another run, and the difference is a warning.

    Returns:
        ``[problem]`` (also logged).

    Raises:
        UserError: ``<problem> (<fix>, or pass --drafter to benchmark another drafter)`` for the run's own export.
    """
    if own_export:
        raise UserError(f"{problem} ({fix}, or pass --drafter to benchmark another drafter)")
    log.warning(problem)
    return [problem]
