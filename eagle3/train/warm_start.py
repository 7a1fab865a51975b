"""The drafter's start: a seeded init from the verifier head (:func:`init_drafter`), or a warm start from an exported
drafter (``train.init_from``): the checks that its folder fits this run, before anything is written, and the copy of
its trainable tensors (``lm_head`` rows moved by target token, so another stage-03 vocab map is allowed)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Collection, Optional

import torch
from torch import nn

from eagle3.drafter.model import Eagle3Drafter
from eagle3.errors import UserError
from eagle3.manifest import DrafterManifest
from eagle3.train import checkpoint as ckpt
from eagle3.train import resume_checks
from eagle3.verifier.head import TargetHead

log = logging.getLogger(__name__)


def init_drafter(args, head: TargetHead, vocab: dict, seed: int):
    """Build the drafter: seeded init (``Eagle3Drafter`` defaults), the verifier embedding (frozen),
    the d2t/t2d vocab map, and ``lm_head`` = the verifier's LM-head rows of the draft vocab.

    Returns:
        ``Eagle3Drafter`` (float32, CPU).

    Raises:
        UserError: the drafter hidden size differs from the verifier's (:func:`require_verifier_width`).
    """
    require_verifier_width(args.hidden_size, head.embed.shape[1])
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(args).float()
    drafter.load_embeddings(head.embed.float())  # [V, H], frozen
    drafter.set_vocab_map(vocab["d2t"], vocab["t2d"])
    target_ids = torch.arange(args.draft_vocab_size, dtype=torch.int64) + vocab["d2t"]  # [dV]
    with torch.no_grad():
        drafter.lm_head.weight.copy_(head.lm_head.float()[target_ids])  # [dV, H]
    drafter.embed_tokens.weight.requires_grad_(False)
    return drafter


def require_verifier_width(hidden_size: int, verifier_hidden: int, source: str = "") -> None:
    """The drafter's ``hidden_size`` must be the verifier's ``verifier_hidden`` (EAGLE-3 drafters reuse the verifier's
    token embedding); ``source``: where the verifier's was read, named when given.

    Raises:
        UserError: ``drafter.hidden_size: <h> differs from the verifier hidden size <v> (<source>); ...``.
    """
    if int(hidden_size) != int(verifier_hidden):
        where = f" ({source})" if source else ""
        raise UserError(
            f"drafter.hidden_size: {hidden_size} differs from the verifier hidden size "
            f"{verifier_hidden}{where}; the drafter reuses the verifier's token embedding: set "
            f"drafter.hidden_size: {verifier_hidden} (or null, the verifier's)"
        )


def warm_start(drafter: nn.Module, src: nn.Module, source: str) -> dict:
    """Copy ``src``'s trainable tensors into ``drafter`` (in place; ``train.init_from``'s warm start).

    Both are :class:`eagle3.drafter.model.Eagle3Drafter`; ``drafter`` is this run's freshly initialised one (its
    frozen ``embed_tokens``, its vocab map and so its ``lm_head`` rows = the verifier's rows of its draft ids stay
    where ``src`` has nothing for them). Every trainable tensor of ``drafter`` but ``lm_head.weight`` must exist in
    ``src`` with the same shape, and ``src``'s trainable set must hold nothing else; the variant and the target vocab
    must be equal. ``lm_head.weight`` (``[draft_V, H]``) is copied by target token (:func:`_source_rows`): under
    another stage-03 map each draft token that ``src`` also drafts gets ``src``'s row for it, the others keep their
    verifier init; under the same map that is a plain copy.

    Returns:
        ``{"tensors": copied tensors, "lm_head_rows": this run's draft_V, "lm_head_rows_copied": rows from src}``.

    Raises:
        UserError: naming ``source`` and the first difference (variant, target vocab, a tensor).
    """
    mine = {n: p for n, p in drafter.named_parameters() if p.requires_grad}
    theirs = dict(src.named_parameters())
    problem = _warm_start_problem(drafter.args, src.args, mine, theirs)
    if problem:
        raise UserError(f"{source}: train.init_from{problem}")
    src_rows = _source_rows(drafter, src)  # [dV] -1 where src does not draft that token
    hit = src_rows >= 0  # [dV]
    with torch.no_grad():
        for name, p in mine.items():
            if name == "lm_head.weight":
                p[hit.to(p.device)] = theirs[name][src_rows[hit]].to(
                    p.device, p.dtype
                )  # [n_hit, H]
            else:
                p.copy_(theirs[name].to(p.device, p.dtype))
    return {
        "tensors": len(mine),
        "lm_head_rows": drafter.d2t.numel(),
        "lm_head_rows_copied": int(hit.sum()),
    }


def _warm_start_problem(args, src_args, mine: dict, theirs: dict) -> Optional[str]:
    """The first reason :func:`warm_start` cannot copy ``theirs`` (the source's parameters, ``src_args``) into
    ``mine`` (this run's trainable ones, ``args``), the words after ``train.init_from``; None when it can."""
    a, b = getattr(src_args, "variant", "eagle3"), getattr(args, "variant", "eagle3")
    if a != b:
        return f" is a {a} drafter but this run trains {b} (drafter.variant)"
    if int(src_args.target_vocab_size) != int(args.target_vocab_size):
        return (
            f" drafts for a verifier vocab of {src_args.target_vocab_size} tokens, this run's verifier has "
            f"{args.target_vocab_size} (another tokenizer)"
        )
    for name, p in mine.items():
        if name not in theirs:
            return f" has no tensor '{name}' (drafter shape differs from the config)"
        # lm_head: its rows move by target token (warm_start), its width must match
        cut = 1 if name == "lm_head.weight" else 0
        if theirs[name].shape[cut:] != p.shape[cut:]:
            return (
                f"'s '{name}' is {list(theirs[name].shape)}, this run's drafter needs {list(p.shape)} "
                f"(drafter.* settings differ)"
            )
    extra = sorted(n for n, p in theirs.items() if n not in mine and n != "embed_tokens.weight")
    return f" has tensor '{extra[0]}' that this run's drafter does not train" if extra else None


def _source_rows(drafter: nn.Module, src: nn.Module) -> torch.Tensor:
    """int64 ``[dV]``: for each draft id of ``drafter``, the draft id of ``src`` that names the same target token
    (row ``i`` names target ``i + d2t[i]``), -1 where ``src`` does not draft that token."""
    dv_new, dv_old = drafter.d2t.numel(), src.d2t.numel()
    tgt_new = torch.arange(dv_new) + drafter.d2t.cpu()  # [dV] target ids of this run's draft ids
    tgt_old = torch.arange(dv_old) + src.d2t.cpu()  # [dV_src]
    row_of = torch.full((int(drafter.args.target_vocab_size),), -1, dtype=torch.long)  # [V]
    row_of[tgt_old] = torch.arange(dv_old)
    return row_of[tgt_new]


# DrafterArgs fields that fix the shape of a trainable tensor (or, variant, which tensors exist): a warm start needs
# them equal; draft_vocab_size may differ (lm_head rows move by target token), the rest (norm eps, rope, context) shape
# nothing
WARM_START_SHAPE = (
    "attention",
    "variant",
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "target_hidden_size",
    "target_vocab_size",
)


def check_init_from(init_from: Optional[str], drafter: dict, config_keys: Collection[str]) -> bool:
    """The warm-start checks made before anything is written: ``init_from`` (``train.init_from``) is an export folder
    (``config.json`` + ``model.safetensors``) whose recorded ``drafter_args`` (:class:`eagle3.manifest.DrafterManifest`;
    absent ``variant`` / ``num_layers`` / ``attention``: the DrafterArgs defaults; none: an export of another tool, not
    compared) hold ``drafter``'s values (:data:`WARM_START_SHAPE` field -> this run's value, None: not known yet; an MLA
    drafter's ``num_key_value_heads`` / ``head_dim`` are not compared). The rest is :func:`warm_start`'s to check.

    Returns:
        whether a warm start is configured (``init_from`` set).

    Raises:
        UserError: the folder missing or not an export (:func:`init_from_not_a_folder`, or ``... is not an exported
            drafter folder (no config.json; ...)``); a malformed metadata file; the first differing field, named
            ``drafter.<field>`` when one of ``config_keys``, else ``from the verifier and its shards``.
    """
    if not init_from:
        return False
    problem = _init_from_problem(init_from, drafter, config_keys)
    if problem:
        raise UserError(problem)
    return True


def _init_from_problem(
    init_from: str, drafter: dict, config_keys: Collection[str]
) -> Optional[str]:
    """:func:`check_init_from`'s refusal of ``init_from``, or None."""
    path = Path(init_from)
    if not path.is_dir():
        return str(init_from_not_a_folder(path))
    missing = next(
        (n for n in ("config.json", "model.safetensors") if not (path / n).is_file()), None
    )
    if missing:
        return (
            f"train.init_from: '{init_from}' is not an exported drafter folder (no {missing}; 04 writes one "
            f"into {{output_root}}/drafter-sglang)"
        )
    meta = DrafterManifest.of_folder(path)
    if meta is None or meta.drafter_args is None:
        return None
    if drafter.get("attention") == "mla":  # derived from the MLA sizes (eagle3/drafter/mla.py)
        drafter = {k: v for k, v in drafter.items() if k not in ("num_key_value_heads", "head_dim")}
    have = {"variant": "eagle3", "num_layers": 1, "attention": "llama", **meta.drafter_args}
    key = next(
        (k for k, b in drafter.items() if k in have and b is not None and have[k] != b), None
    )
    if key is None:
        return None
    where = f"drafter.{key}" if key in config_keys else "from the verifier and its shards"
    return (
        f"train.init_from: '{init_from}' holds a drafter with {key} {have[key]!r}, this run "
        f"trains {drafter[key]!r} ({where})"
    )


def init_from_not_a_folder(path: Path) -> UserError:
    """The error for a ``train.init_from`` that is no folder: missing, or a file (a checkpoint ``step_*.pt`` or a
    ``model.safetensors`` given for its folder)."""
    if not path.exists():
        return UserError(
            f"train.init_from: folder '{path}' not found (an exported drafter folder: 04's drafter-sglang)"
        )
    hint = (
        " (a checkpoint: export it with 04_train.py --export-only, or continue its run with --resume and its "
        "train.output_dir)"
        if path.suffix == ".pt"
        else ""
    )
    return UserError(
        f"train.init_from: '{path}' is a file, not an exported drafter folder; give the folder "
        f"(04's drafter-sglang or drafter-vllm){hint}"
    )


def warm_start_planned(
    init_from: Optional[str],
    train_dir: Path,
    is_main: bool,
    resume: bool,
    args,
) -> bool:
    """Whether this call warm-starts from ``init_from`` (``train.init_from``): set, and no ``--resume`` checkpoint in
    ``train_dir`` to continue (it holds the run's weights, the warm start's included); checked against ``args`` first
    (:func:`check_init_from`, whose UserErrors it raises).
    """
    if not init_from:
        return False
    if resume and ckpt.list_checkpoints(train_dir):
        if is_main:
            log.info(
                "train.init_from (%s) not used: --resume continues from the run's checkpoint",
                init_from,
            )
        return False
    mine = {key: getattr(args, key) for key in WARM_START_SHAPE}
    return check_init_from(init_from, mine, resume_checks.DRAFTER_CONFIG_KEYS)
