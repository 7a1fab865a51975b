"""The drafter folder stage 05 benchmarks: ``--drafter`` checked to be an export (a file, 04's train folder or a
folder without ``config.json`` refused with what to pass instead), the advice when the config's export is missing,
and the export's loading beside a loaded verifier."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

from eagle3.decoding.checks import TRAIN_META
from eagle3.errors import UserError
from eagle3.export.reader import load_exported
from eagle3.io.read import relative_hint
from eagle3.train.checkpoint import ckpt_dir, list_checkpoints


def export_folder(path: Path, missing_advice: Optional[Callable[[], str]] = None) -> Path:
    """``path`` when it is an exported drafter folder (it holds the ``config.json`` every export holds).

    ``missing_advice`` None: ``path`` is ``--drafter``'s, and a file, a missing folder or 04's train folder is named
    with what to pass instead. Else ``path`` is the config's export dir, and ``missing_advice()`` is the line for it
    not found (:func:`missing_export_advice`). A folder without ``config.json`` is named as such, with the exports it
    holds when it is an output root (:func:`_not_an_export`).

    Raises:
        UserError: one line naming the folder, where it came from and what to pass instead.
    """
    problem = _folder_problem(path, missing_advice)
    if problem:
        raise UserError(problem)
    return path


def _folder_problem(path: Path, missing_advice: Optional[Callable[[], str]]) -> Optional[str]:
    """:func:`export_folder`'s refusal of ``path``, or None when it is an export."""
    if missing_advice is not None:
        if not path.is_dir():
            return missing_advice()
        return _not_an_export(path, f"the config's export dir '{path}'")
    hint = f"; {relative_hint(path)}" if relative_hint(path) else ""
    if path.is_file():  # a checkpoint file, not "folder not found"
        problem = (
            f"'{path}' is a file, not an exported drafter folder; pass the folder 04 exported (drafter-sglang), "
            f"or export a checkpoint first with 04_train.py --export-only"
        )
    elif not path.is_dir():
        problem = f"folder '{path}' not found (export a trained drafter first{hint})"
    elif not (path / "config.json").is_file() and (path / "checkpoints").is_dir():
        problem = (
            f"'{path}' is 04's train folder, not an exported drafter; pass the export folder (drafter-sglang "
            f"beside it, or export.output_dir), or write it with 04_train.py --export-only"
        )
    else:
        return _not_an_export(path, f"--drafter: '{path}'")
    return f"--drafter: {problem}"


def _not_an_export(path: Path, what: str) -> Optional[str]:
    """``<what> is not an exported drafter folder (no config.json) ...`` for a folder without the ``config.json``
    every export holds (a shards, data or output-root folder; an output root that holds an export is pointed at it),
    or None when it has one."""
    if (path / "config.json").is_file():
        return None
    inside = sorted(
        p.name
        for p in path.iterdir()
        if p.is_dir() and (p / "config.json").is_file() and (p / TRAIN_META).is_file()
    )
    hint = (
        f"it holds the export{'s' if len(inside) > 1 else ''} {', '.join(inside)}: pass "
        f"{' or '.join(str(path / n) for n in inside)}"
        if inside
        else "pass the folder 04 exported (drafter-sglang, or export.output_dir), or write it with "
        "04_train.py --export-only"
    )
    return f"{what} is not an exported drafter folder (no config.json); {hint}"


def missing_export_advice(
    path: Path, train_dir: Path, engine: str, root: Path, export_output_dir: Optional[str]
) -> str:
    """The line refusing a missing config export dir (``path``), with advice that works for the train folder as it is:
    with checkpoints, ``--export-only`` (for the other engine's existing export, from the same checkpoint) or
    ``--resume``; without, train (or pass ``--drafter``). ``train_dir``, ``engine`` (``export.engine``), ``root``
    (``output_root``) and ``export_output_dir`` (``export.output_dir``) are the config's."""
    found = list_checkpoints(train_dir)
    other = "vllm" if engine == "sglang" else "sglang"
    have = root / f"drafter-{other}"
    if export_output_dir is None and (have / "config.json").is_file():  # exported for the other
        head = (
            f"the exported drafter '{path}' (the config's export dir, export.engine: {engine}) not "
            f"found, but {have} is there"
        )
        if found:
            return (
                f"{head}: 04_train.py --export-only --engine {engine} writes it from the same "
                f"checkpoint (or pass --drafter)"
            )
        return (
            f"{head}; {ckpt_dir(train_dir)} holds no checkpoint to export it from (04_train.py --export-only "
            f"needs one): benchmark {have} with --set export.engine={other}, or train again for {engine}"
        )
    head = f"the exported drafter '{path}' (the config's export dir) not found"
    if found:
        return (
            f"{head}, but {ckpt_dir(train_dir)} holds checkpoints (newest step {found[-1][0]}): "
            f"04_train.py --export-only exports it, 04_train.py --resume trains on to the run's end and exports "
            f"(or pass --drafter)"
        )
    return f"{head}: run 04_train.py first or pass --drafter" + (
        f" ({relative_hint(path)})" if relative_hint(path) else ""
    )


def load_drafter(drafter_dir: Path, verifier, device, dtype):
    """The exported drafter of ``drafter_dir`` on ``device`` in ``dtype`` (eval mode), sharing the loaded verifier's
    input embedding."""
    embed = verifier.get_input_embeddings().weight
    drafter = load_exported(drafter_dir, embed_weight=embed)
    return drafter.to(device=device, dtype=dtype).eval()
