"""The drafter's start: a seeded init from the verifier head (:func:`init_drafter`), or a warm start from an exported
drafter (``train.init_from``): the checks that its folder fits this run, before anything is written, and the copy of
its trainable tensors (``lm_head`` rows moved by target token, so another stage-03 vocab map is allowed)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Collection, Optional

import torch
from torch import nn

from eagle3.drafter.draft_config import EXPORT_META_FILE
from eagle3.drafter.model import Eagle3Drafter
from eagle3.errors import UserError
from eagle3.io import read_json
from eagle3.train import checkpoint as ckpt
from eagle3.verifier.head import TargetHead

log = logging.getLogger(__name__)


def init_drafter(args, head: TargetHead, vocab: dict, seed: int):
    """Build the drafter: seeded init (``Eagle3Drafter`` defaults), the verifier embedding (frozen),
    the d2t/t2d vocab map, and ``lm_head`` = the verifier's LM-head rows of the draft vocab.

    Returns:
        ``Eagle3Drafter`` (float32, CPU).

    Raises:
        UserError: the drafter hidden size differs from the verifier's (EAGLE-3 drafters reuse
            the verifier's token embedding, so the widths must agree).
    """
    if head.embed.shape[1] != args.hidden_size:
        raise UserError(
            f"drafter.hidden_size: {args.hidden_size} differs from the verifier hidden size "
            f"{head.embed.shape[1]}; the drafter reuses the verifier's token embedding: set "
            f"drafter.hidden_size: {head.embed.shape[1]} (or null, the verifier's)"
        )
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(args).float()
    drafter.load_embeddings(head.embed.float())  # [V, H], frozen
    drafter.set_vocab_map(vocab["d2t"], vocab["t2d"])
    target_ids = torch.arange(args.draft_vocab_size, dtype=torch.int64) + vocab["d2t"]  # [dV]
    with torch.no_grad():
        drafter.lm_head.weight.copy_(head.lm_head.float()[target_ids])  # [dV, H]
    drafter.embed_tokens.weight.requires_grad_(False)
    return drafter


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
    a, b = getattr(src.args, "variant", "eagle3"), getattr(drafter.args, "variant", "eagle3")
    if a != b:
        raise UserError(
            f"{source}: train.init_from is a {a} drafter but this run trains {b} (drafter.variant)"
        )
    if int(src.args.target_vocab_size) != int(drafter.args.target_vocab_size):
        raise UserError(
            f"{source}: train.init_from drafts for a verifier vocab of {src.args.target_vocab_size} tokens, "
            f"this run's verifier has {drafter.args.target_vocab_size} (another tokenizer)"
        )
    mine = {n: p for n, p in drafter.named_parameters() if p.requires_grad}
    theirs = dict(src.named_parameters())
    for name, p in mine.items():
        if name not in theirs:
            raise UserError(
                f"{source}: train.init_from has no tensor '{name}' (drafter shape differs from the config)"
            )
        cut = 1 if name == "lm_head.weight" else 0  # lm_head: rows move (below), width must match
        if theirs[name].shape[cut:] != p.shape[cut:]:
            raise UserError(
                f"{source}: train.init_from's '{name}' is {list(theirs[name].shape)}, this run's drafter "
                f"needs {list(p.shape)} (drafter.* settings differ)"
            )
    extra = sorted(n for n, p in theirs.items() if n not in mine and n != "embed_tokens.weight")
    if extra:
        raise UserError(
            f"{source}: train.init_from has tensor '{extra[0]}' that this run's drafter does not train"
        )
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


def check_init_from_shape(src: str, exported: dict, args, config_keys: Collection[str]) -> None:
    """Refuse a ``train.init_from`` export whose drafter shape differs from the one this run trains, before anything
    is written (the full tensor check of :func:`warm_start` runs later, after the verifier head is extracted).

    Args:
        src: the export folder (for the message).
        exported: the export's ``drafter_args`` (``eagle3_train.json``; absent keys take DrafterArgs' defaults:
            ``variant`` eagle3 and ``num_layers`` 1 for exports written before those fields existed).
        args: this run's :class:`eagle3.drafter.args.DrafterArgs`.
        config_keys: the ``drafter.*`` config keys (a differing field is named as one of them, else as taken from
            the verifier and its shards).

    Raises:
        UserError: naming the first differing field, e.g. ``train.init_from: 'x/drafter-sglang' holds a drafter with
            num_layers 1, this run trains 2 (drafter.num_layers)``.
    """
    check_shape_fields(
        src, exported, {key: getattr(args, key) for key in WARM_START_SHAPE}, config_keys
    )


def check_shape_fields(src: str, exported: dict, mine: dict, config_keys: Collection[str]) -> None:
    """The first field of ``mine`` (shape field -> this run's value; None = not known yet) that differs from the
    export's ``drafter_args`` (absent ``variant`` / ``num_layers``: the DrafterArgs defaults eagle3 / 1); UserError
    naming ``drafter.<field>`` when the field is one of ``config_keys``."""

    have = {"variant": "eagle3", "num_layers": 1, "attention": "llama", **exported}
    for key, b in mine.items():
        # not recorded (left to warm_start's tensor-by-tensor check) or not known
        if key not in have or b is None:
            continue
        a = have[key]
        if a != b:
            where = f"drafter.{key}" if key in config_keys else "from the verifier and its shards"
            raise UserError(
                f"train.init_from: '{src}' holds a drafter with {key} {a!r}, this run trains {b!r} ({where})"
            )


def check_init_from(init_from: Optional[str], drafter: dict, config_keys: Collection[str]) -> bool:
    """The part of the warm-start checks that needs neither the verifier nor the shards: ``init_from``
    (``train.init_from``) is an export folder (``config.json`` + ``model.safetensors``) and the drafter shape fields
    the config itself fixes (``drafter``: field -> the config's value, None = from the verifier) equal the export's
    recorded ``drafter_args`` (``eagle3_train.json``). 04 checks the full shape later, before its first write.

    Returns:
        whether a warm start is configured (``init_from`` set).

    Raises:
        UserError: the folder missing or not an export, or a differing field (as :func:`check_init_from_shape`).
    """
    if not init_from:
        return False
    exported = exported_drafter_args(init_from)
    if exported is not None:
        if (
            drafter.get("attention") == "mla"
        ):  # MLA derives these two from its sizes (eagle3/drafter/mla.py)
            drafter = {
                k: v for k, v in drafter.items() if k not in ("num_key_value_heads", "head_dim")
            }
        check_shape_fields(init_from, exported, drafter, config_keys)
    return True


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


def exported_drafter_args(src: str) -> Optional[dict]:
    """The ``drafter_args`` an export folder records (``eagle3_train.json``: EXPORT_META_FILE), after checking
    that ``src`` is an exported drafter folder (``config.json`` + ``model.safetensors``); None when the metadata is
    absent or holds no ``drafter_args`` object (an export of another tool: left to the tensor-by-tensor check).

    Raises:
        UserError: the folder is missing or not an export; the metadata is not valid JSON.
    """
    path = Path(src)
    if not path.is_dir():
        raise init_from_not_a_folder(path)
    for name in ("config.json", "model.safetensors"):
        if not (path / name).is_file():
            raise UserError(
                f"train.init_from: '{src}' is not an exported drafter folder (no {name}; 04 writes one "
                f"into {{output_root}}/drafter-sglang)"
            )
    if not (path / EXPORT_META_FILE).is_file():
        return None

    meta = read_json(path / EXPORT_META_FILE)
    exported = meta.get("drafter_args") if isinstance(meta, dict) else None
    return exported if isinstance(exported, dict) else None


def warm_start_planned(
    init_from: Optional[str],
    train_dir: Path,
    is_main: bool,
    resume: bool,
    args,
    config_keys: Collection[str],
) -> bool:
    """Whether this call warm-starts from ``init_from`` (``train.init_from``): set, and no ``--resume`` checkpoint in
    ``train_dir`` to continue (that one holds the run's weights, the warm start's included). Checks, before anything
    is written, that the folder looks like an export (``config.json`` + ``model.safetensors``) and that the export's
    recorded drafter shape is this run's ``args``' (:func:`check_init_from_shape`).

    Raises:
        UserError: ``train.init_from: folder ... not found`` / ``... is not an exported drafter folder`` / a shape
            field that differs.
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
    exported = exported_drafter_args(init_from)
    if args is not None and exported is not None:
        check_init_from_shape(init_from, exported, args, config_keys)
    return True
