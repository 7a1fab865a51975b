"""Stage 04's setup from :class:`Setup` (the config sections and folders it reads): inputs (drafter shape, verifier
head, init and warm start, hidden-state source), data (datasets, order, step horizon) and optimisation (TTT
objective, DDP / compile, AdamW, warmup + cosine schedule), each checked before the first write.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from eagle3.data.batching import sample_lengths
from eagle3.data.dataset import ShardDataset
from eagle3.drafter.args import DrafterArgs
from eagle3.drafter.mla import mla_drafter_fields
from eagle3.errors import UserError
from eagle3.io import make_dirs
from eagle3.process_group import Dist
from eagle3.shards.checks import check_verifier_dims
from eagle3.shards.data_config import expect_from_data_config
from eagle3.train import checkpoint as ckpt
from eagle3.train.folder import check_train_dir
from eagle3.train.loop import TTTObjective
from eagle3.train.online import state_source
from eagle3.train.order import TrainData, data_inputs, data_order
from eagle3.train.schedule import build_scheduler
from eagle3.train.warm_start import (
    init_drafter,
    require_verifier_width,
    warm_start,
    warm_start_planned,
)
from eagle3.verifier.arch import text_config
from eagle3.verifier.head import FILENAME as TARGET_HEAD_FILE
from eagle3.verifier.head import TargetHead, load_target_head_from_safetensors
from eagle3.verifier.load import (
    load_verifier,
    load_verifier_config,
    verifier_dims,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Setup:
    """The config's ``train``, ``drafter``, ``verifier`` and ``extract`` sections, the run's folders, ``train_dir``'s key."""

    train: Any
    drafter: Any
    verifier: Any
    extract: Any
    train_dir: Path
    data_dir: Path
    shards_dir: Path
    train_field: str = "train.output_dir"


SHAPE_FIELDS = (
    "hidden_size num_attention_heads num_key_value_heads head_dim intermediate_size rms_norm_eps rope_theta "
    "max_position_embeddings"
).split()
"""The ``drafter`` shape fields: null = the verifier's; all set (Llama attention), the verifier's config is not read."""


def build_drafter_args(s: Setup, data_config: dict, vocab: dict):
    """``DrafterArgs`` from ``s.drafter`` (``s``: a :class:`Setup` or the run config); null fields come from the verifier
    config (read only then; ``head_dim``: :func:`_head_dim`), vocab sizes from ``vocab``, ``target_hidden_size`` from
    ``data_config``. The export engine's context rule was decided at 04's start
    (:func:`eagle3.stages.export.check_export_serves`, whose ``planned_context`` follows this function's rule).

    Raises:
        UserError: unreadable verifier config or an invalid shape (field named).
    """

    given = {f: getattr(s.drafter, f) for f in SHAPE_FIELDS}
    fixed = dict(  # vocab sizes from the map, the feature width from the shards
        draft_vocab_size=int(vocab["draft_vocab_size"]),
        target_vocab_size=int(vocab["target_vocab_size"]),
        target_hidden_size=int(data_config["hidden_size"]),
    )
    mla_given = s.drafter.mla.model_dump() if s.drafter.attention == "mla" else None
    if mla_given is None and all(v is not None for v in given.values()):
        return DrafterArgs(
            **given, **fixed, variant=s.drafter.variant, num_layers=s.drafter.num_layers
        )
    hf = load_verifier_config(s.verifier)
    dims = verifier_dims(hf)
    check_verifier_dims(dims, data_config, s.shards_dir)  # before a drafter field's symptom
    over = {**given, "head_dim": _head_dim(given, dims)}
    if mla_given is not None:  # MLA sizes: drafter.mla over the verifier's (eagle3/drafter/mla.py)
        heads = given["num_attention_heads"] or dims["num_attention_heads"]
        over.update(mla_drafter_fields(mla_given, heads, text_config(hf)))
    return DrafterArgs.from_hf_config(
        text_config(hf),
        fixed["draft_vocab_size"],
        **over,
        **{k: v for k, v in fixed.items() if k != "draft_vocab_size"},
        variant=s.drafter.variant,
        num_layers=s.drafter.num_layers,
    )


def _head_dim(given: dict, dims: dict) -> int:
    """``drafter.head_dim``, else hidden / heads when either is set, else the verifier's (MLA: ``verifier_dims``)."""
    if given["head_dim"] is not None:
        return given["head_dim"]
    if given["hidden_size"] is not None or given["num_attention_heads"] is not None:
        h = given["hidden_size"] or dims["hidden_size"]
        return h // (given["num_attention_heads"] or dims["num_attention_heads"])
    return dims["head_dim"]


def warn_world_size(s: Setup, d: Dist) -> Optional[str]:
    """Warn (rank 0) when ``train.nproc_per_node`` is set and differs from the process count; returns the text or None."""
    want = s.train.nproc_per_node
    if "nproc_per_node" not in s.train.model_fields_set or want == d.world:
        return None
    t = s.train
    batch = (
        f"{t.batch_size} x {t.grad_accum} x {d.world} = {t.batch_size * t.grad_accum * d.world} samples per "
        f"optimizer step instead of {t.batch_size * t.grad_accum * want}"
        if t.batch_tokens is None
        else f"{d.world}/{want} of the planned tokens per optimizer step"
    )
    msg = (
        f"train.nproc_per_node: the config plans {want} processes but 04 runs in {d.world} (WORLD_SIZE): "
        f"{batch}; start it with `torchrun --nproc_per_node {want} 04_train.py ...`, or set "
        f"train.nproc_per_node: {d.world} if this is intended"
    )
    if d.is_main:
        log.warning("%s", msg)
    return msg


def prepare_target_head(s: Setup, data_config: dict, d: Dist) -> TargetHead:
    """``{train_dir}/target_head.safetensors`` (rank 0 extracts it from the verifier first when missing: three tensors of
    a safetensors checkpoint, or the model through transformers for GGUF). UserError: unlike ``data_config.json``.
    """
    path = s.train_dir / TARGET_HEAD_FILE
    if d.is_main and not path.is_file():
        log.info("extracting the verifier's embedding / lm_head / final norm to %s", path)
        vdir = s.verifier.resolved_path()
        if s.verifier.gguf_file is None and any(vdir.glob("*.safetensors*")):
            load_target_head_from_safetensors(vdir, data_config["last_hidden_state"]).save(
                s.train_dir
            )
        else:
            model, _tok = load_verifier(s.verifier, device="cpu")
            TargetHead.from_model(model, data_config["last_hidden_state"]).save(s.train_dir)
            del model
    d.barrier()
    head = TargetHead.load(path)
    problem = head_problem(head, data_config)
    if problem:
        raise UserError(f"{path}: {problem} (delete it to re-extract)")
    return head


def head_problem(head: TargetHead, data_config: dict) -> Optional[str]:
    """How the extracted verifier head differs from the shards' ``data_config.json`` (its shape ``[vocab_size,
    hidden_size]``, else which final hidden state its norm applies to), or None when it agrees."""
    want = (int(data_config["vocab_size"]), int(data_config["hidden_size"]))
    if (head.vocab_size, head.hidden_size) != want:
        return (
            f"head is [{head.vocab_size}, {head.hidden_size}] but data_config.json says vocab_size "
            f"{data_config['vocab_size']}, hidden_size {data_config['hidden_size']}"
        )
    if head.last_is_post_norm != (data_config["last_hidden_state"] == "post_norm"):
        return (
            f"metadata 'last_is_post_norm' is {head.last_is_post_norm} but data_config.json says "
            f"last_hidden_state={data_config['last_hidden_state']!r}"
        )
    return None


def autocast_dtype(bf16: str, device: torch.device) -> Optional[torch.dtype]:
    """bf16 autocast on GPU unless ``train.bf16`` is ``off``; None (float32) on CPU."""
    if device.type != "cuda":
        if bf16 == "on":
            log.warning(
                "train.bf16=on ignored: bf16 autocast is used on GPU only (CPU trains in float32)"
            )
        return None
    return torch.bfloat16 if bf16 in ("auto", "on") else None


def recipe(s: Setup) -> dict:
    """The training recipe a checkpoint records (key ``recipe``, dotted config keys), compared on ``--resume``."""
    keys = (
        "ttt_length step_weight loss lk_eta lr weight_decay warmup_ratio epochs max_steps grad_clip"
    )
    out = {f"train.{k}": getattr(s.train, k) for k in keys.split()}
    return {**out, "extract.max_length": s.extract.max_length}


def resume_current(s: Setup, args, split: dict, vocab: dict, data_config: dict) -> dict:
    """The run now as :func:`eagle3.train.resume_checks.check_resume` compares it."""
    return {
        "drafter_args": dataclasses.asdict(args),
        "data_order": data_order(
            s.train.seed, s.train.batch_tokens, s.train.batch_size, s.train.grad_accum
        ),
        "recipe": recipe(s),
        "data_inputs": data_inputs(split, vocab, data_config),
    }


def fingerprint(s: Setup, args) -> str:
    """The checkpoint's ``config_fingerprint`` of the training settings (``loss`` keys only when not soft_ce)."""
    t = s.train
    keys = "ttt_length step_weight lr weight_decay warmup_ratio epochs batch_size grad_accum grad_clip seed"
    keep = {k: getattr(t, k) for k in keys.split()}
    # recorded only when set, so that fingerprints of earlier runs stay what they were
    if t.loss != "soft_ce":
        keep.update(loss=t.loss, lk_eta=t.lk_eta)
    drafter = args.to_json()  # num_layers only when > 1
    return ckpt.config_fingerprint(
        {"train": keep, "drafter": drafter, "max_length": s.extract.max_length}
    )


@dataclass
class Inputs:
    """What the inputs step fixes: metadata, vocab map, split, drafter shape and init, the verifier head on the device
    (``head_lm`` ``[V, Ht]``, ``head_norm`` ``[Ht]`` or None for a post-norm last state), autocast and feature dtypes,
    the hidden-state source; ``init_from``: the warm start of this call (None: cold or resumed).
    """

    data_config: dict
    vocab: dict
    split: dict
    args: Any
    drafter: nn.Module
    amp: Optional[torch.dtype]
    feat_dtype: torch.dtype
    head_lm: torch.Tensor
    head_norm: Optional[torch.Tensor]
    head_eps: float
    d2t: torch.Tensor
    t2d: torch.Tensor
    states: Any
    init_from: Optional[str] = None


def _drafter_and_folder(
    s: Setup, d: Dist, data_config: dict, vocab: dict, split: dict, resume: bool, lock
):
    """The drafter shape and warm-start plan, checked before anything is written; then 04's lock (``lock()``) and the
    folder check. Returns ``(args, warm)``.
    """
    args = build_drafter_args(s, data_config, vocab)
    # init_drafter's check, before the head
    require_verifier_width(
        args.hidden_size, data_config["hidden_size"], str(s.shards_dir / "data_config.json")
    )
    warm = warm_start_planned(s.train.init_from, s.train_dir, d.is_main, resume, args)
    if lock is not None:
        lock()  # before the folder check deletes stale temp files
    check_train_dir(
        s.train_dir,
        s.data_dir,
        d,
        resume,
        lambda: {**resume_current(s, args, split, vocab, data_config), "world_size": d.world},
    )
    return args, warm


def load_inputs(
    s: Setup,
    d: Dist,
    data_config: dict,
    vocab: dict,
    split: dict,
    resume: bool,
    init: Optional[Callable] = None,
    stop_check: Callable[[], None] = lambda: None,
    lock: Optional[Callable[[], None]] = None,
) -> Inputs:
    """The inputs step: drafter shape and plan, the verifier head, drafter init and warm start (``init(embed_weight
    [V, H], data_config)`` loads ``train.init_from``'s drafter), the hidden-state source; ``stop_check()`` between
    them honours a signal.
    """
    args, warm = _drafter_and_folder(s, d, data_config, vocab, split, resume, lock)
    stop_check()
    head = prepare_target_head(s, data_config, d)  # the first write: target_head.safetensors
    if d.is_main:
        make_dirs(s.train_dir, s.train_field)
    stop_check()  # the head's extraction can take minutes (verifier weights)
    drafter = init_drafter(args, head, vocab, s.train.seed)
    if warm:
        _warm_start(s, d, drafter, init, data_config)
    drafter = drafter.to(d.device)
    amp = autocast_dtype(s.train.bf16, d.device)
    feat_dtype = torch.bfloat16 if amp is not None else torch.float32
    inputs = Inputs(
        data_config=data_config,
        vocab=vocab,
        split=split,
        args=args,
        drafter=drafter,
        amp=amp,
        feat_dtype=feat_dtype,
        head_lm=head.lm_head.to(d.device, feat_dtype),  # [V, Ht]
        head_norm=None if head.last_is_post_norm else head.norm_weight.to(d.device, feat_dtype),
        head_eps=float(head.norm_eps),
        d2t=vocab["d2t"].to(d.device),
        t2d=vocab["t2d"].to(d.device),
        states=None,
        init_from=s.train.init_from if warm else None,
    )
    del head
    stop_check()
    inputs.states = state_source(s, d, data_config, feat_dtype)
    return inputs


def _warm_start(s: Setup, d: Dist, drafter, init: Optional[Callable], data_config: dict):
    """``train.init_from``'s tensors into ``drafter`` (``init`` loads the export)."""
    if init is None:
        raise UserError(
            "train.init_from: needs the export loader that 04_train.py passes (trainer.run(init=...))"
        )
    ws = warm_start(drafter, init(drafter.embed_tokens.weight, data_config), s.train.init_from)
    if d.is_main:
        moved = ws["lm_head_rows_copied"] < ws["lm_head_rows"]
        log.info(
            "warm start from %s: %d trainable tensors; lm_head %d of %d draft tokens from it%s",
            s.train.init_from,
            ws["tensors"],
            ws["lm_head_rows_copied"],
            ws["lm_head_rows"],
            " (another vocab map: the rest keep the verifier's rows)" if moved else "",
        )


@dataclass
class Data:
    """What the data step fixes: datasets, this rank's order, the step horizon and what set it, the eval cadence."""

    train_ds: ShardDataset
    val_ds: Optional[ShardDataset]
    order: TrainData
    total_steps: int
    val_lengths: Optional[list[int]]
    eval_every: Optional[int]  # None: at the end of each epoch
    horizon: Optional[int]  # max_steps / train.max_steps (None: the epochs decide)
    # what sets total_steps: "train.epochs E" / "--max-steps N" / "train.max_steps N"
    horizon_from: str = "train.epochs"


def build_data(s: Setup, d: Dist, inputs: Inputs, max_steps: Optional[int]) -> Data:
    """The data step: datasets over the shards (without states when computed online), the order, the total optimizer
    steps (capped by ``max_steps`` / ``train.max_steps``).
    """
    t = s.train
    max_len = int(inputs.data_config["max_length"])
    split_file = s.data_dir / "split.json"  # named in a missing-shard error

    expect, states = expect_from_data_config(inputs.data_config), inputs.states.reads_shard_states

    def dataset(name: str) -> ShardDataset:
        ids = inputs.split[name]
        return ShardDataset(s.shards_dir, ids, max_len, expect, name, states, split_file)

    train_ds = dataset("train")
    val_ds = dataset("val") if inputs.split["val"] else None
    order = TrainData(
        train_ds,
        d,
        batch_size=t.batch_size,
        grad_accum=t.grad_accum,
        batch_tokens=t.batch_tokens,
        seed=t.seed,
        epochs=t.epochs,
        num_workers=t.num_workers,
        shards_dir=s.shards_dir,
        split_file=split_file,
    )
    horizon = max_steps if max_steps is not None else t.max_steps
    total_steps = order.total_steps if horizon is None else min(order.total_steps, horizon)
    val_lengths = (
        sample_lengths(s.shards_dir, val_ds, max_len)
        if (val_ds is not None and t.batch_tokens)
        else None
    )
    given = (
        f"--max-steps {max_steps}" if max_steps is not None else f"train.max_steps {t.max_steps}"
    )
    capped = horizon is not None and horizon < order.total_steps
    horizon_from = given if capped else f"train.epochs {t.epochs:g}"
    data = Data(
        train_ds, val_ds, order, total_steps, val_lengths, t.eval_every, horizon, horizon_from
    )
    if d.is_main:
        _data_notes(s, data, given)
    return data


def _data_notes(s: Setup, data: Data, given: str) -> None:
    """Rank 0's lines: a cap above the epochs' steps, the samples an epoch leaves out, sim_accept with nothing to select."""
    t, order = s.train, data.order
    if data.horizon is not None and data.horizon > order.total_steps:
        log.warning(
            "%s is more than the %d optimizer steps of train.epochs %g; it only caps that schedule, so the "
            "run ends after %d steps (raise train.epochs for a longer run)",
            given,
            order.total_steps,
            t.epochs,
            order.total_steps,
        )
    note = order.left_out_note(len(data.train_ds))
    if note:
        log.info(note)
    if t.select_best != "sim_accept":
        return
    if data.val_ds is None:
        log.warning(no_val_selection(s))
    elif t.eval_every is not None and t.eval_every >= data.total_steps:
        log.warning(
            f"train.eval_every {t.eval_every} is not below the run's {data.total_steps} optimizer steps: only "
            f"the final validation runs and train.select_best: sim_accept has only that one to select from, so "
            f"the last step's weights are exported (lower train.eval_every, or leave it unset to validate at "
            f"each epoch's end)"
        )


def no_val_selection(s: Setup) -> str:
    """The warning of ``train.select_best: sim_accept`` without a validation split."""
    return (
        f"train.select_best: sim_accept has no validation split to select from ({s.data_dir / 'split.json'} "
        f"key 'val' is empty: stage 03 ran with data.val_fraction 0); the last step's weights are exported instead"
    )


@dataclass
class Optimisation:
    objective: TTTObjective
    model: nn.Module  # the objective, wrapped in DDP and/or torch.compile
    params: list
    optimizer: torch.optim.Optimizer
    scheduler: Any
    fingerprint: str


def build_optimisation(s: Setup, d: Dist, inputs: Inputs, total_steps: int) -> Optimisation:
    """The optimisation step: the TTT objective (DDP, torch.compile), AdamW over the trainable parameters, the warmup +
    cosine schedule over ``total_steps``.
    """
    t = s.train
    ckpt_logits = t.checkpoint_logits == "on"
    if t.compile and ckpt_logits:
        raise UserError(
            "train.checkpoint_logits: 'on' cannot be combined with train.compile: true (torch.compile "
            "fails on the checkpointed loss); use 'auto' or 'off'"
        )
    objective = TTTObjective(
        inputs.drafter, t.ttt_length, t.step_weight, ckpt_logits, loss=t.loss, lk_eta=t.lk_eta
    )
    model = objective
    if d.distributed:
        model = DDP(objective, device_ids=[d.device.index] if d.device.type == "cuda" else None)
    if t.compile:
        if t.batch_tokens is not None and d.is_main:
            log.warning(
                "train.compile with train.batch_tokens: batch size, length and loss-row count all vary; "
                "on the H200 this did not reach 60 SmolLM2 steps in 3 minutes (recompiles), while "
                "uncompiled token-budget training ran 155K tokens/s (bench/small_train_speed.py)"
            )
        model = torch.compile(model, dynamic=True)
    params = [p for p in inputs.drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        params, lr=t.lr, weight_decay=t.weight_decay, fused=d.device.type == "cuda"
    )
    scheduler = build_scheduler(optimizer, total_steps, t.warmup_ratio)
    return Optimisation(objective, model, params, optimizer, scheduler, fingerprint(s, inputs.args))
