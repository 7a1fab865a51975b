"""The drafter folder stage 05 benchmarks: ``--drafter`` checked to be an export (a file, 04's train folder or a
folder without ``config.json`` refused with what to pass instead), the advice when the config's export is missing,
and the export's loading beside a loaded verifier."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from eagle3.decoding.checks import TRAIN_META
from eagle3.errors import UserError
from eagle3.export.reader import load_exported
from eagle3.io.read import relative_hint
from eagle3.train.checkpoint import ckpt_dir, list_checkpoints


def check_drafter_arg(drafter_dir: str | Path) -> Path:
    """The folder ``--drafter`` names, refused unless it is an exported drafter folder.

    Raises:
        UserError: a file, a missing folder, 04's train folder or a folder without ``config.json``, each named with
            what to pass instead.
    """
    path = Path(drafter_dir)
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
        require_export_config(path, f"--drafter: '{path}'")
        return path
    raise UserError(f"--drafter: {problem}")


def require_export_config(path: Path, what: str) -> None:
    """Refuse a folder without the ``config.json`` every export holds, naming it and what it holds instead.

    A shards, data or output-root folder given to ``--drafter`` is named as such; an output root that holds an
    export is pointed at it.

    Raises:
        UserError: ``<what> is not an exported drafter folder (no config.json) ...``.
    """
    if (path / "config.json").is_file():
        return
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
    raise UserError(f"{what} is not an exported drafter folder (no config.json); {hint}")


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
