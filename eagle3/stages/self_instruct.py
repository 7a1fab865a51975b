"""Stage 01's self-instruct prompts from the run config: the CLI mode (``01_prepare_prompts.py --self-instruct N
--out FILE``, :func:`run`) and ``prompts.self_instruct`` inside a normal 01 run (:func:`make_from_config`, the file
``{output_root}/self_instruct.jsonl``), both through :func:`eagle3.regen.self_instruct.make` with the config's
verifier, chat template options, system prompt and seed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from eagle3.chat.template import ChatOptions
from eagle3.cli import refuse_torchrun
from eagle3.config import RunConfig
from eagle3.regen import self_instruct as si
from eagle3.settings.prompts import SELF_INSTRUCT_BATCH


def make(
    cfg: RunConfig, out: Path, num: int, *, batch_size: int = SELF_INSTRUCT_BATCH, **kw
) -> bool:
    """:func:`eagle3.regen.self_instruct.make` of ``out`` with ``cfg``'s verifier, template options
    (``extract.loss_on_reasoning`` included), ``prompts.system_prompt`` and ``prompts.seed``; ``kw``: its
    sampling and filter settings, ``exclude``, ``force`` and ``names``. Returns True when it sampled ``out``."""
    return si.make(
        cfg.verifier,
        out,
        num,
        opts=ChatOptions.from_verifier(cfg.verifier, cfg.extract.loss_on_reasoning),
        system_prompt=cfg.prompts.system_prompt,
        seed=cfg.prompts.seed,
        batch_size=batch_size,
        **kw,
    )


def run(
    cfg: RunConfig,
    num: int,
    out: Path,
    temperature: float = 1.0,
    top_p: float = 1.0,
    max_query_tokens: int = 128,
    min_chars: int = 16,
    exclude: Sequence[str] = (),
    force: bool = False,
    batch_size: int = SELF_INSTRUCT_BATCH,
) -> int:
    """01's self-instruct mode (``--self-instruct N --out FILE``): check the arguments, then :func:`make` ``out``.

    Returns:
        0 (also when up to date).

    Raises:
        UserError: a bad argument (one line naming its flag), an unwritable output folder, an ``--out`` that is a
            folder or named like 01's output, more than one torchrun rank, or :func:`make`'s errors.
    """
    # a folder named with its slash (Path drops it), existing or not
    folder = str(out).endswith("/")
    out = Path(out)
    si.check_args(num, temperature, top_p, max_query_tokens, min_chars, out, folder)
    refuse_torchrun("--self-instruct", "it takes seconds to minutes on one GPU")
    make(
        cfg,
        out,
        num,
        temperature=temperature,
        top_p=top_p,
        max_query_tokens=max_query_tokens,
        min_chars=min_chars,
        exclude=exclude,
        force=force,
        batch_size=batch_size,
    )
    return 0


def make_from_config(cfg: RunConfig, force: bool = False) -> Path:
    """``prompts.self_instruct``'s file, ``cfg.self_instruct_path`` (``{output_root}/self_instruct.jsonl``), made by
    :func:`make` with its settings, or found up to date. One process: under torchrun 01 calls it on rank 0 only.

    Returns:
        The file's path (a messages-JSONL of one user turn a row, ids ``self_instruct/<k>``).

    Raises:
        UserError: :func:`make`'s, naming ``prompts.self_instruct.*``; the output folder must exist.
    """
    sc, out = cfg.prompts.self_instruct, cfg.self_instruct_path
    make(
        cfg,
        out,
        sc.num,
        temperature=sc.temperature,
        top_p=sc.top_p,
        max_query_tokens=sc.max_query_tokens,
        min_chars=sc.min_chars,
        exclude=sc.exclude,
        force=force,
        names=si.CONFIG_NAMES,
        batch_size=sc.batch_size,
    )
    return out
