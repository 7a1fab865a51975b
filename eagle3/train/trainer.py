"""Stage 04: train an EAGLE-3 drafter with training-time test (TTT) on the captured shards.

One call of :func:`run` does, on every process (single process, or ``torchrun`` ranks):

1. torch.distributed from the torchrun environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``):
   NCCL on GPU, gloo on CPU; without those variables it runs as a single process.
2. Drafter shape (:func:`build_drafter_args`): ``cfg.drafter`` fields, ``null`` ones copied from the
   verifier's text config (``eagle3.verifier.load.verifier_dims``); vocab sizes from ``vocab_map.pt``,
   ``target_hidden_size`` from ``data_config.json``.
3. Verifier head (:mod:`eagle3.verifier.head`): ``{train_dir}/target_head.safetensors``, extracted
   from the verifier once by rank 0 and reused on every resume.
4. Drafter init (:func:`init_drafter`): token embedding = the verifier's (frozen, as in EAGLE-3 and
   SpecForge); ``lm_head`` = the verifier's LM-head rows of the draft vocabulary when the drafter
   hidden size equals the verifier's (a warm start: if the drafter's output matched the verifier's
   final hidden state, step 0 would reproduce the verifier's distribution on the draft vocab);
   everything else is PyTorch default init under ``train.seed``.
5. Loop: AdamW, warmup + cosine per optimizer step (:mod:`eagle3.train.schedule`), gradient
   accumulation (DDP ``no_sync`` on the non-final micro-batches), gradient clipping, bf16 autocast
   on GPU only. Micro-batches hold ``batch_size`` samples, or with ``train.batch_tokens`` samples of
   similar length up to that many padded tokens (:mod:`eagle3.data.batching`), read by loader worker
   processes into pinned memory. The loss is the TTT loss of :func:`eagle3.train.ttt.ttt_loss` evaluated
   only at the loss rows that ``collate`` lists on the host (:mod:`eagle3.train.ttt_rows`: verifier targets
   and draft logits there only), normalised over the counted tokens of the whole optimizer step
   (:func:`backward_step`). SDPA runs without cuDNN (:func:`eagle3.sdpa.no_cudnn_sdpa`). No host syncs in a
   step except at log steps (every ``log_every``), where loss, per-TTT-step accuracy, LR, grad
   norm and tokens/s go to TensorBoard (``{train_dir}/tb``), ``{train_dir}/metrics.jsonl`` and the
   tqdm bar (rank 0).
6. Validation on the ``val`` split every ``eval_every`` steps (default at each epoch's end) and at the end:
   each sample once (rank r takes samples r, r+W, ...), loss and accuracy token-weighted over all of them.
7. Checkpoints (:mod:`eagle3.train.checkpoint`) every ``ckpt_every`` steps, on SIGTERM/SIGINT (the current
   step finishes first, then :func:`run` returns with ``stopped``; 04's CLI exits 128 + signal) and at the end; ``resume=True``
   continues from the newest complete one, bit-identically on CPU (data order, LR, RNG).
8. Export (rank 0) with :func:`eagle3.export.writer.export_drafter` to ``cfg.export_dir``, and a report
   ``{train_dir}/train_report.{json,md}`` + ``loss.png``.

Loss normalisation (DESIGN.md "Loss normalisation"): the loss of TTT step ``i`` is the sum of the
token cross-entropies over the counted positions of the whole optimizer step (all micro-batches, all
ranks) divided by their number, so the gradient does not depend on how the step's samples are split
into micro-batches and ranks (batch 2 x accumulation 1 == batch 1 x accumulation 2 == 2 ranks x
batch 1). Each micro-batch's counts are taken before any backward pass of the step and summed over
ranks by one all-reduce per optimizer step (:func:`eagle3.train.ttt.step_denominators`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from eagle3.config import RunConfig
from eagle3.data.batching import eval_batches, sample_lengths
from eagle3.data.dataset import ResumableSampler, ShardDataset, collate, read_split
from eagle3.data.settings import data_settings, require_current
from eagle3.data.validation_record import require_passed
from eagle3.data.vocab import load_run_vocab_map
from eagle3.drafter.draft_config import EXPORT_META_FILE
from eagle3.engines.layers import check_servable
from eagle3.errors import UserError
from eagle3.io import (
    append_bytes,
    atomic_write_jsonl,
    cut_torn_tail,
    disk_full_guard,
    make_dirs,
    open_append,
    probe_dirs,
    read_json,
)
from eagle3.process_group import Dist, init_dist, process_group_scope, torchrun_env
from eagle3.shards.format import (
    check_extract_settings,
    check_verifier,
    check_verifier_dims,
    expect_from_data_config,
    read_data_config,
)
from eagle3.shards.fp8 import dequantize_batch, is_fp8
from eagle3.train import checkpoint as ckpt
from eagle3.train.schedule import build_scheduler
from eagle3.verifier.head import FILENAME as TARGET_HEAD_FILE
from eagle3.verifier.head import TargetHead

log = logging.getLogger(__name__)

TARGET_CHUNK = 2048  # positions per lm_head chunk in compute_targets (bounds the [chunk, V] logits)


# ---------------------------------------------------------------------------------------------
# distributed setup
# ---------------------------------------------------------------------------------------------
def init_distributed(device: Optional[str] = None) -> Dist:
    """This rank's :class:`eagle3.process_group.Dist` from the torchrun env; NCCL when CUDA is available, else gloo.

    Args:
        device: ``"cpu"`` forces CPU (and gloo); None = ``cuda:{LOCAL_RANK}`` if available else CPU.

    Returns:
        a single process (world 1) when ``WORLD_SIZE`` is unset or 1; its device is set either way.
    """
    local_rank = torchrun_env()[2]
    use_cuda = torch.cuda.is_available() and device != "cpu"
    dev = torch.device(f"cuda:{local_rank}") if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(dev)
    return init_dist(backend="nccl" if use_cuda else "gloo", device=dev)


def _dotted(tree: dict, prefix: str = "") -> dict:
    """A nested config dump as ``{"train.lr": 0.001, ...}``."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            out.update(_dotted(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _ranks_agree(cfg: RunConfig, d: Dist, args: dict) -> None:
    """Every torchrun rank must train under rank 0's config and command line. Each rank reads them itself; one with
    another ``train.lr`` (a node with another copy of the YAML) stepped its DDP replica with its own lr, the replicas
    drifting apart without a word, and one with another ``train.batch_size`` aborted rank 0 (SIGABRT) with no
    message. The ranks now compare the whole config and the stage's flags first.

    Raises:
        UserError: on every rank, naming the first rank that differs from rank 0 and the differing keys.
    """
    if not d.distributed:
        return
    mine = {**_dotted(cfg.model_dump(mode="json")), **args}
    everyone: list = [None] * d.world
    dist.all_gather_object(everyone, mine, group=d.ctrl_group)
    first = everyone[0]
    for r, theirs in enumerate(everyone):
        keys = sorted(
            k
            for k in set(theirs) | set(first)
            if theirs.get(k, "<absent>") != first.get(k, "<absent>")
        )
        if keys:
            shown = ", ".join(
                f"{k}: {first.get(k, '<absent>')!r} on rank 0, {theirs.get(k, '<absent>')!r} on rank {r}"
                for k in keys[:4]
            ) + (f" (and {len(keys) - 4} more)" if len(keys) > 4 else "")
            raise UserError(
                f"torchrun rank {r} runs 04 with another config or command line than rank 0 ({shown}); "
                f"every rank must read the same YAML, --set overrides and flags (a node with another copy?)"
            )


def _same_data(cfg: RunConfig, inputs: "_Inputs", d: Dist) -> None:
    """Every torchrun rank must train on rank 0's data: 03's split and vocab map (content sha256), the shards' aux
    layers and verifier weights (:func:`_data_inputs`). Each rank reads them itself; a rank on a node with another
    copy of the data folder trained other samples (or targets) without a word.

    Raises:
        UserError: on every rank, naming the first rank whose data differs from rank 0's and the differing inputs.
    """
    if not d.distributed:
        return
    everyone: list = [None] * d.world
    dist.all_gather_object(
        everyone, _data_inputs(inputs.split, inputs.vocab, inputs.data_config), group=d.ctrl_group
    )
    for r, theirs in enumerate(everyone):
        keys = sorted(
            k for k in set(theirs) | set(everyone[0]) if theirs.get(k) != everyone[0].get(k)
        )
        if keys:
            raise UserError(
                f"{cfg.data_dir}: torchrun rank {r} read other data than rank 0 (differing: "
                f"{', '.join(keys)}); every rank must read the same data folder and shards (a node with "
                f"another copy?)"
            )


def _same_checkpoint(train_dir: Path, found: Optional[tuple], d: Dist) -> None:
    """Every torchrun rank must resume from rank 0's checkpoint. Each rank looks for it itself; a rank that saw no
    checkpoint (a node-local ``train.output_dir``) or another newest one started from another step than rank 0, and
    the DDP replicas trained on from different weights and data positions.

    Raises:
        UserError: on every rank, naming the first rank whose checkpoint differs from rank 0's.
    """
    if not d.distributed:
        return
    mine = None if found is None else (found[0].name, int(found[1]["step"]))
    everyone: list = [None] * d.world
    dist.all_gather_object(everyone, mine, group=d.ctrl_group)
    say = lambda w: "no checkpoint" if w is None else f"{w[0]} (step {w[1]})"  # noqa: E731
    for r, theirs in enumerate(everyone):
        if theirs != everyone[0]:
            raise UserError(
                f"{ckpt.ckpt_dir(train_dir)}: --resume: torchrun rank {r} found {say(theirs)}, rank 0 "
                f"{say(everyone[0])}; every rank must see the same train.output_dir (a node-local folder?)"
            )


def _barrier(d: Dist) -> None:
    if d.distributed:
        dist.barrier(group=d.ctrl_group)


def _any_rank(flag: bool, d: Dist) -> bool:
    """True if ``flag`` is True on any rank (one CPU all-reduce on the gloo control group)."""
    if not d.distributed:
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=d.ctrl_group)
    return bool(t.item())


def _sum_ranks(values: list[float], d: Dist) -> list[float]:
    if not d.distributed:
        return values
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, group=d.ctrl_group)
    return t.tolist()


# ---------------------------------------------------------------------------------------------
# model construction
# ---------------------------------------------------------------------------------------------
def build_drafter_args(cfg: RunConfig, data_config: dict, vocab: dict, warn_context: bool = True):
    """``DrafterArgs`` from ``cfg.drafter``; ``null`` fields are copied from the verifier config.

    The verifier config is read (``eagle3.verifier.load.load_verifier_config``, no weights) only when
    some field is null; then :meth:`eagle3.drafter.model.DrafterArgs.from_hf_config` fills it from the
    text model config (nested ``text_config`` unwrapped), with ``head_dim`` = hidden / heads for
    MLA verifiers (Kimi/DeepSeek: :func:`eagle3.verifier.load.verifier_dims`). Vocab sizes come from
    ``vocab_map.pt``; ``target_hidden_size`` from ``data_config.json``. ``warn_context``: warn when the draft's
    context is below the verifier's (:func:`warn_short_context`; 04's start); ``--export-only`` passes False, since
    the export's own check then says it once, as the error (SGLang) or the warning (vLLM).

    Raises:
        UserError: unreadable verifier config, or an invalid shape (field named by ``DrafterArgs``).
    """
    from eagle3.drafter.model import DrafterArgs

    def checked(args):
        return warn_short_context(cfg, args) if warn_context else args

    fields = (
        "hidden_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "intermediate_size",
        "rms_norm_eps",
        "rope_theta",
        "max_position_embeddings",
    )
    given = {f: getattr(cfg.drafter, f) for f in fields}
    fixed = dict(
        draft_vocab_size=int(vocab["draft_vocab_size"]),
        target_vocab_size=int(vocab["target_vocab_size"]),
        target_hidden_size=int(data_config["hidden_size"]),
    )
    if all(v is not None for v in given.values()):
        return checked(
            DrafterArgs(
                **given, **fixed, variant=cfg.drafter.variant, num_layers=cfg.drafter.num_layers
            )
        )
    from eagle3.verifier.arch import text_config
    from eagle3.verifier.load import load_verifier_config, verifier_dims

    hf = load_verifier_config(cfg.verifier)
    dims = verifier_dims(hf)
    check_verifier_dims(
        cfg.verifier, dims, data_config, cfg.shards_dir
    )  # before a symptom in a drafter field
    over = dict(given)
    if over["head_dim"] is None:
        if over["hidden_size"] is not None or over["num_attention_heads"] is not None:
            h = over["hidden_size"] or dims["hidden_size"]
            over["head_dim"] = h // (over["num_attention_heads"] or dims["num_attention_heads"])
        else:
            over["head_dim"] = dims["head_dim"]
    return checked(
        DrafterArgs.from_hf_config(
            text_config(hf),
            fixed["draft_vocab_size"],
            **over,
            **{k: v for k, v in fixed.items() if k != "draft_vocab_size"},
            variant=cfg.drafter.variant,
            num_layers=cfg.drafter.num_layers,
        )
    )


def warn_short_context(cfg: RunConfig, args):
    """Warn at the start of 04 when the drafter's context is below the verifier's: the export for
    SGLang will be refused, vLLM caps the draft (:func:`eagle3.engines.context.check_context_length`).

    Returns:
        ``args`` unchanged.
    """
    from eagle3.engines.context import check_context_length
    from eagle3.verifier.load import verifier_context_length

    try:
        check_context_length(args, verifier_context_length(cfg.verifier), "sglang")
    except UserError as e:
        log.warning("%s. The SGLang export will be refused; vLLM caps the draft at that length.", e)
    return args


def warn_world_size(cfg: RunConfig, d: Dist) -> Optional[str]:
    """Warn (rank 0) when the config plans ``train.nproc_per_node`` processes and 04 runs in another number: a plain
    ``python 04_train.py --config configs/kimi-k2.5.yaml`` trained on one GPU with an eighth of the planned global
    batch, without a word (rehearsal 2026-12-05g). Only a value the config sets is compared (the default 1 is not a
    plan), and a resume on fewer GPUs stays possible: this is a warning, not a refusal.

    Returns:
        The warning's text, or None.
    """
    want = cfg.train.nproc_per_node
    if "nproc_per_node" not in cfg.train.model_fields_set or want == d.world:
        return None
    t = cfg.train
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


def prepare_target_head(cfg: RunConfig, data_config: dict, d: Dist) -> TargetHead:
    """Load ``{train_dir}/target_head.safetensors``; rank 0 extracts it from the verifier first if missing.

    Extraction reads only the three tensors from a safetensors checkpoint
    (:func:`eagle3.verifier.head.load_target_head_from_safetensors`, Kimi-sized verifiers), or
    loads the model through transformers for GGUF verifiers (:func:`eagle3.verifier.load.load_verifier`).

    Raises:
        UserError: the head does not match ``data_config.json`` (hidden size, vocab size, norm convention).
    """
    path = cfg.train_dir / TARGET_HEAD_FILE
    if d.is_main and not path.is_file():
        log.info("extracting the verifier's embedding / lm_head / final norm to %s", path)
        vdir = cfg.verifier.resolved_path()
        if cfg.verifier.gguf_file is None and any(vdir.glob("*.safetensors*")):
            from eagle3.verifier.head import load_target_head_from_safetensors

            load_target_head_from_safetensors(vdir, data_config["last_hidden_state"]).save(
                cfg.train_dir
            )
        else:
            from eagle3.verifier.load import load_verifier

            model, _tok = load_verifier(cfg.verifier, device="cpu")
            TargetHead.from_model(model, data_config["last_hidden_state"]).save(cfg.train_dir)
            del model
    _barrier(d)
    head = TargetHead.load(path)
    if head.hidden_size != int(data_config["hidden_size"]) or head.vocab_size != int(
        data_config["vocab_size"]
    ):
        raise UserError(
            f"{path}: head is [{head.vocab_size}, {head.hidden_size}] but data_config.json says vocab_size "
            f"{data_config['vocab_size']}, hidden_size {data_config['hidden_size']} (delete it to re-extract)"
        )
    want_post = data_config["last_hidden_state"] == "post_norm"
    if head.last_is_post_norm != want_post:
        raise UserError(
            f"{path}: metadata 'last_is_post_norm' is {head.last_is_post_norm} but data_config.json says "
            f"last_hidden_state={data_config['last_hidden_state']!r} (delete it to re-extract)"
        )
    return head


def init_drafter(args, head: TargetHead, vocab: dict, seed: int):
    """Build the drafter: seeded init (``Eagle3Drafter`` defaults), the verifier embedding (frozen),
    the d2t/t2d vocab map, and ``lm_head`` = the verifier's LM-head rows of the draft vocab.

    Returns:
        ``Eagle3Drafter`` (float32, CPU).

    Raises:
        UserError: the drafter hidden size differs from the verifier's (EAGLE-3 drafters reuse
            the verifier's token embedding, so the widths must agree).
    """
    from eagle3.drafter.model import Eagle3Drafter

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


class TTTObjective(nn.Module):
    """The drafter + TTT loss as one ``forward``, so that DDP sees every trainable use in forward.

    ``forward(input_ids [B,L] int64, aux [B,L,3Ht], target_logp [B,L,dV] float32, in_draft [B,L] bool,
    target_argmax [B,L] int64, loss_mask [B,L], denom [K] float32 | None) -> (loss scalar, metrics)``,
    where ``metrics`` is :func:`eagle3.train.ttt.ttt_loss`'s dict of per-TTT-step tensors ``[K]`` (``loss``,
    ``ce_sum``, ``acc``, ``correct``, ``count``) and ``denom`` its per-step denominators (None = this
    batch's own counts). With ``loss_pos`` (int64 ``[M]``, :func:`eagle3.data.dataset.loss_positions`) instead
    of ``loss_mask``, the targets are the ``[M, dV]``, ``[M]``, ``[M]`` rows of
    :func:`eagle3.train.ttt_rows.row_targets` and the loss is :func:`eagle3.train.ttt_rows.ttt_loss_rows` (same sums;
    logits only where the loss can count; what training uses).

    Args:
        checkpoint_logits: recompute each step's ``[B, L, dV]`` logits in backward instead of
            storing them (``ttt_loss(checkpoint=True)``); used on GPU, where memory binds.
    """

    def __init__(
        self,
        drafter: nn.Module,
        ttt_length: int,
        step_weight: float,
        checkpoint_logits: bool = False,
        loss: str = "soft_ce",
        lk_eta: float = 3.0,
    ):
        super().__init__()
        self.drafter = drafter
        self.ttt_length = ttt_length
        self.step_weight = step_weight
        self.checkpoint_logits = checkpoint_logits
        self.loss = loss
        self.lk_eta = lk_eta

    def forward(
        self,
        input_ids,
        aux,
        target_logp,
        in_draft,
        target_argmax,
        loss_mask=None,
        denom=None,
        loss_pos=None,
    ):
        from eagle3.train.ttt import TTTTargets, ttt_loss

        step_hiddens = self.drafter.ttt_forward(input_ids, aux, self.ttt_length)  # K x [B, L, H]
        if loss_pos is not None:
            from eagle3.train.ttt_rows import ttt_loss_rows

            return ttt_loss_rows(
                self.drafter,
                step_hiddens,
                TTTTargets(target_logp, in_draft, target_argmax),
                loss_pos,
                step_weight=self.step_weight,
                checkpoint=self.checkpoint_logits,
                denom=denom,
                loss=self.loss,
                lk_eta=self.lk_eta,
            )
        return ttt_loss(
            self.drafter,
            step_hiddens,
            TTTTargets(target_logp, in_draft, target_argmax),
            loss_mask,
            step_weight=self.step_weight,
            checkpoint=self.checkpoint_logits,
            denom=denom,
            loss=self.loss,
            lk_eta=self.lk_eta,
        )


def backward_step(
    model: nn.Module,
    batches: list[dict],
    targets: list,
    ttt_length: int,
    d: Dist,
    amp: Optional[torch.dtype] = None,
) -> list[dict]:
    """Forward + backward of every micro-batch of ONE optimizer step, with the step-normalised loss.

    First the counted positions of each micro-batch and TTT step (:func:`eagle3.train.ttt.ttt_token_counts`,
    known from the loss mask and the verifier targets before any backward pass) are summed over the
    micro-batches and, under DDP, over ranks (:func:`eagle3.train.ttt.step_denominators`: one all-reduce per
    optimizer step, queued on the device, no host sync). Then each micro-batch's loss
    ``sum_i step_weight**i * S_i / denom_i`` is backpropagated (DDP ``no_sync`` on all but the last),
    so the accumulated gradient is that of ``sum_i step_weight**i * (step sum of CE of step i) / N_i``
    whatever the split into micro-batches and ranks. Gradients accumulate into ``.grad``; the caller
    clips, steps and zeroes.

    Args:
        model: :class:`TTTObjective`, possibly wrapped in DDP and/or ``torch.compile``.
        batches: the micro-batches of this rank (``input_ids`` ``[B,L]``, ``aux`` ``[B,L,3Ht]``,
            ``loss_mask`` ``[B,L]``, on the device); sizes may differ between micro-batches. A batch with
            ``loss_pos`` (``eagle3.data.dataset.collate``) uses the loss-row path (:mod:`eagle3.train.ttt_rows`).
        targets: :class:`eagle3.train.ttt.TTTTargets` of each batch (all alive at once: ``len(batches)`` x
            ``[B, L, draft_V]`` float32, or ``[M, draft_V]`` rows with ``loss_pos``).
        ttt_length: ``K``.
        d: this process's :class:`Dist` (every rank must call this once per optimizer step).
        amp: autocast dtype on the device, or None.

    Returns:
        :func:`eagle3.train.ttt.ttt_loss`'s detached metrics of each micro-batch.
    """
    from eagle3.train.ttt import step_denominators, ttt_token_counts
    from eagle3.train.ttt_rows import ttt_row_counts

    counts = [
        ttt_row_counts(b["loss_pos"], b["input_ids"].shape[1], tg.in_draft, ttt_length)
        if "loss_pos" in b
        else ttt_token_counts(b["loss_mask"], tg.in_draft, ttt_length)
        for b, tg in zip(batches, targets)
    ]  # [K] each
    denom = step_denominators(counts, d.world)  # [K] float32: max(N_i, 1) / world
    stats = []
    for m, (b, tg) in enumerate(zip(batches, targets)):
        last = m == len(batches) - 1
        sync_ctx = model.no_sync() if (d.distributed and not last) else contextlib.nullcontext()
        amp_ctx = (
            torch.autocast(device_type=d.device.type, dtype=amp)
            if amp is not None
            else contextlib.nullcontext()
        )
        with sync_ctx:
            with amp_ctx:
                if "loss_pos" in b:
                    loss, st = model(
                        b["input_ids"],
                        b["aux"],
                        tg.logp_draft,
                        tg.in_draft,
                        tg.argmax,
                        None,
                        denom,
                        loss_pos=b["loss_pos"],
                    )
                else:
                    loss, st = model(
                        b["input_ids"],
                        b["aux"],
                        tg.logp_draft,
                        tg.in_draft,
                        tg.argmax,
                        b["loss_mask"],
                        denom,
                    )
            loss.backward()
        stats.append(st)
    return stats


def trainable_state(drafter: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters that training changes (``requires_grad``), detached on CPU, by name."""
    return {
        n: p.detach().to("cpu").clone() for n, p in drafter.named_parameters() if p.requires_grad
    }


# ---------------------------------------------------------------------------------------------
# signals
# ---------------------------------------------------------------------------------------------
class StopFlag:
    """SIGTERM/SIGINT set a flag; the loop finishes the current optimizer step, checkpoints and returns.

    A second SIGINT falls through to the previous handler (so Ctrl-C twice still aborts).
    Handlers are installed only in the main thread and restored by :meth:`restore`.
    """

    def __init__(self):
        self.requested = False
        self.signum: Optional[int] = None
        self._old: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGTERM, signal.SIGINT):
                self._old[s] = signal.signal(s, self._handle)

    def _handle(self, signum, frame):
        if self.requested and signum == signal.SIGINT:
            old = self._old.get(signum)
            if callable(old):
                old(signum, frame)
            raise KeyboardInterrupt
        self.requested = True
        self.signum = signum

    def restore(self) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old = {}


def stop_before_training(stop: Optional[StopFlag], d: Dist) -> None:
    """Honour a signal that came before the first optimizer step of this call (04's start-up: data checks, verifier
    head, drafter init, hidden-state source): stop now, with nothing trained and no checkpoint written, instead of
    training a step first. Called between the setup steps and before the first step; every rank calls it at the same
    points and they agree (:func:`_any_rank`).

    Raises:
        eagle3.cli.Terminated: a ``KeyboardInterrupt`` carrying the signal (``run_main`` prints ``interrupted by
            SIGINT: <hint>`` and exits 128 + signal); inside the setup, :func:`_undo_on_refusal` removes what this
            call created.
    """
    if stop is None or not _any_rank(stop.requested, d):
        return
    from eagle3.cli import Terminated

    e = Terminated(stop.signum or signal.SIGTERM)
    e.hint = (
        "stopped during start-up, before the first optimizer step: nothing trained, no checkpoint written; "
        "re-run the same command"
    )
    raise e


# ---------------------------------------------------------------------------------------------
# metrics
# ---------------------------------------------------------------------------------------------
class _Metrics:
    """Rank-0 sinks: ``metrics.jsonl`` (append + flush), TensorBoard."""

    def __init__(self, train_dir: Path, start_step: int, enabled: bool, finished: bool = False):
        """Rows of steps after ``start_step`` (written before a kill, redone now) are dropped; so is the
        final validation row when the run had already ``finished`` (it is recomputed). A torn last line (a kill
        mid-append) is cut first (:func:`eagle3.io.cut_torn_tail`): the next row would join it, both lost."""
        self.enabled = enabled
        self.path = train_dir / "metrics.jsonl"
        self.tb = None
        if not enabled:
            return
        torn = cut_torn_tail(
            self.path
        )  # else the next row would join the torn one: both lost (trial 2026-12-05g)
        if torn:
            log.warning(
                "%s: cut a torn last line (%d bytes a kill left mid-write) before appending",
                self.path,
                torn,
            )
        rows = _read_metrics(self.path)
        kept = [
            r
            for r in rows
            if r.get("step", 0) < start_step
            or (r.get("step", 0) == start_step and not (finished and r.get("kind") == "val"))
        ]
        if len(kept) != len(rows) or (self.path.exists() and start_step == 0):
            atomic_write_jsonl(self.path, kept if start_step else [])
        from torch.utils.tensorboard import SummaryWriter

        self.tb = SummaryWriter(
            log_dir=str(train_dir / "tb"), purge_step=start_step if start_step else None
        )

    def write(self, row: dict) -> None:
        if not self.enabled:
            return
        with open_append(self.path) as f:  # disk full: rolled back, UserError (exit 2)
            append_bytes(f, (json.dumps(row) + "\n").encode("utf-8"), self.path, fsync=False)
        step = row["step"]
        with disk_full_guard(
            self.path.parent / "tb"
        ):  # TensorBoard's writer re-raises its thread's OSError here
            for k, v in row.items():
                if k not in ("step", "epoch", "kind") and isinstance(v, (int, float)):
                    self.tb.add_scalar(f"{row['kind']}/{k}", v, step)
            self.tb.flush()

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def _read_metrics(path: Path) -> list[dict]:
    """Rows of ``metrics.jsonl``; a torn last line (killed mid-write) is skipped."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(
        encoding="utf-8", errors="replace"
    ).splitlines():  # a torn multi-byte tail too
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def _reduce_totals(totals: dict[str, torch.Tensor], d: Dist) -> dict[str, torch.Tensor]:
    """Sum :meth:`_Accum.totals` over ranks (CPU all-reduce on the gloo control group; host sync)."""
    out = {k: v.detach().to("cpu", torch.float64) for k, v in totals.items()}
    if d.distributed:
        for k in sorted(out):
            dist.all_reduce(out[k], group=d.ctrl_group)
    return out


class _Accum:
    """Sums a window of micro-batch results on the device without host syncs; read at log steps.

    ``add(metrics)`` takes :func:`eagle3.train.ttt.ttt_loss`'s metrics. :meth:`summarize` gives, over the
    window and (after :func:`_reduce_totals`) all ranks, token-weighted like the training loss:
    ``step_loss_{i}`` = sum of CE / number of counted positions of TTT step ``i``, ``loss`` =
    ``sum_i step_weight**i * step_loss_{i}`` (for a window of one optimizer step: exactly the loss
    that step minimised), ``acc_{i}`` = sum(correct) / sum(count), ``loss_tokens`` = counted
    positions of step 0. The sums start at zeros ``[K]`` so that every rank reduces the same keys,
    even a rank that saw no batch.
    """

    def __init__(self, ttt_length: int):
        self.sums = {
            k: torch.zeros(ttt_length, dtype=torch.float64) for k in ("ce_sum", "correct", "count")
        }
        self.n = 0

    def add(self, metrics: dict) -> None:
        self.n += 1
        for k in self.sums:
            v = metrics[k].detach().to(torch.float64)  # [K] on the device
            self.sums[k] = (
                v.clone() if self.n == 1 else self.sums[k] + v
            )  # the CPU zeros never meet the device

    def totals(self) -> dict[str, torch.Tensor]:
        """Raw sums (for cross-rank reduction) plus ``n`` (micro-batches)."""
        return dict(self.sums, n=torch.tensor(float(self.n)))

    @staticmethod
    def summarize(sums: dict[str, torch.Tensor], step_weight: float) -> dict[str, float]:
        """Host-side floats from (possibly rank-summed) :meth:`totals`."""
        if not sums or float(sums["n"]) == 0:
            return {}
        count = sums["count"].clamp(min=1)  # [K]
        step_loss = (sums["ce_sum"] / count).tolist()  # [K]
        out = {"loss": sum(step_weight**i * x for i, x in enumerate(step_loss))}
        for i, x in enumerate(step_loss):
            out[f"step_loss_{i}"] = x
        for i, x in enumerate((sums["correct"] / count).tolist()):
            out[f"acc_{i}"] = x
        out["loss_tokens"] = float(sums["count"][0])
        return out


# ---------------------------------------------------------------------------------------------
# data order
# ---------------------------------------------------------------------------------------------
def _loader_kwargs(t, device: torch.device, world: int) -> dict:
    """DataLoader settings: worker processes (``train.num_workers``; auto = up to 8 per rank on GPU by CPU
    count, 0 on CPU), pinned host memory and 4 batches of read-ahead per worker on GPU. Workers are
    started per epoch (not persistent) and stopped when the loop drops its iterator, so none outlive
    :func:`run`."""
    workers = t.num_workers
    if workers is None:
        workers = (
            min(8, max(1, (os.cpu_count() or 2) // max(1, world) - 1))
            if device.type == "cuda"
            else 0
        )
    kw = {"num_workers": workers, "pin_memory": device.type == "cuda", "collate_fn": collate}
    if workers > 0:
        kw.update(prefetch_factor=4)
    return kw


class _TrainData:
    """The training data order of one rank: fixed-size batches (``ResumableSampler``) or token-budget
    batches (:class:`eagle3.data.batching.TokenBudgetBatchSampler`), behind one interface.

    A position in the data is ``(epoch, step_in_epoch)`` (optimizer steps done in that epoch); the
    checkpoint stores it as ``epoch``, ``steps_in_epoch`` and ``samples_in_epoch`` (global samples).
    """

    def __init__(self, cfg: RunConfig, train_ds: ShardDataset, d: Dist):
        t = cfg.train
        self.world, self.accum, self.is_main = (
            d.world,
            t.grad_accum,
            d.is_main,
        )  # is_main: says the resume once
        kw = _loader_kwargs(t, d.device, d.world)
        self.token_budget = t.batch_tokens is not None
        if self.token_budget:
            from eagle3.data import batching

            lengths = batching.sample_lengths(cfg.shards_dir, train_ds, train_ds.max_length)
            self.sampler = batching.TokenBudgetBatchSampler(
                lengths,
                t.batch_tokens,
                d.world,
                d.rank,
                t.grad_accum,
                t.seed,
                window=batching.DEFAULT_WINDOW,
            )
            self.loader = DataLoader(train_ds, batch_sampler=self.sampler, **kw)
            self.total_steps = self.sampler.total_steps(t.epochs)
        else:
            self.sampler = ResumableSampler(
                train_ds, num_replicas=d.world, rank=d.rank, shuffle=True, seed=t.seed
            )
            self.loader = DataLoader(
                train_ds, batch_size=t.batch_size, sampler=self.sampler, drop_last=True, **kw
            )
            self.samples_per_step = (
                t.batch_size * t.grad_accum * d.world
            )  # global samples per optimizer step
            self._steps = (len(train_ds) // d.world) // (t.batch_size * t.grad_accum)
            if self._steps < 1:
                raise UserError(
                    f"{cfg.data_dir / 'split.json'}: key 'train': {len(train_ds)} samples, fewer than one "
                    f"optimizer step needs (batch_size {t.batch_size} x grad_accum {t.grad_accum} x "
                    f"{d.world} processes)"
                )
            self.total_steps = math.ceil(t.epochs * self._steps)

    # A resumed epoch may have been started on another number of processes: it is then described by
    # its origin (epoch, steps done, global units consumed: samples, or batches of the token-budget
    # plan), and the rest of its data is dealt out to the current ranks (each sample at most once per epoch).
    _origin: Optional[tuple[int, int, int]] = None

    def _units_per_step(self) -> int:
        return self.world * self.accum if self.token_budget else self.samples_per_step

    def _units_before(self, epoch: int, step_in_epoch: int) -> int:
        """Global samples (fixed batches) or plan batches (token budget) consumed by ``step_in_epoch`` steps."""
        if self._origin is not None and self._origin[0] == epoch:
            _, k0, g0 = self._origin
            return g0 + (step_in_epoch - k0) * self._units_per_step()
        return step_in_epoch * self._units_per_step()

    def steps_in_epoch(self, epoch: int) -> int:
        if self._origin is not None and self._origin[0] == epoch:
            _, k0, g0 = self._origin
            if self.token_budget:
                return k0 + self.sampler.steps_after(epoch, g0)
            return k0 + (max(0, len(self.sampler.dataset) - g0) // self.world) // (
                self.samples_per_step // self.world
            )
        return self.sampler.steps_in_epoch(epoch) if self.token_budget else self._steps

    def samples_before(self, epoch: int, step_in_epoch: int) -> int:
        """Global samples consumed by the first ``step_in_epoch`` optimizer steps of ``epoch`` (checkpoint key
        ``samples_in_epoch``: the data position, whatever number of processes took those steps)."""
        g = self._units_before(epoch, step_in_epoch)
        if not self.token_budget:
            return g
        return sum(len(b) for b in self.sampler.epoch_plan(epoch)[:g])

    def step_from_checkpoint(self, state: dict) -> int:
        """``steps_in_epoch`` of a checkpoint (derived from ``samples_in_epoch`` for checkpoints that predate it);
        its ``samples_in_epoch`` fixes where the epoch's data resumes, on any number of processes."""
        if "steps_in_epoch" in state:
            k = int(state["steps_in_epoch"])
        elif self.token_budget:
            raise UserError(
                "checkpoint: key 'steps_in_epoch' missing; it was written by a run without "
                "train.batch_tokens, so its data position cannot be mapped to token-budget batches"
            )
        else:
            k = int(state["samples_in_epoch"]) // self.samples_per_step
        epoch = int(state["epoch"])
        if "samples_in_epoch" in state:
            samples = int(state["samples_in_epoch"])
            g = self.sampler.batches_for_samples(epoch, samples) if self.token_budget else samples
        else:  # predates the key: taken on this process count
            g = k * self._units_per_step()
            samples = self.samples_before(epoch, k) if self.token_budget else g
        self._origin = (epoch, k, g)
        if int(state.get("world_size", self.world)) != self.world and self.is_main:
            log.info(
                "checkpoint written on %s processes, now %d: epoch %d resumes after its first %d samples, "
                "the rest dealt out to %d ranks",
                state.get("world_size"),
                self.world,
                epoch,
                samples,
                self.world,
            )
        return k

    def resumed_total_steps(self, epochs: float, step: int) -> int:
        """Optimizer steps of ``epochs`` epochs for a run resumed (:meth:`step_from_checkpoint`) at global
        optimizer step ``step``: the steps taken before the resumed epoch, that epoch's steps on this
        process count from its recorded data position, then whole epochs (a fractional last epoch
        rounded up, counted in samples/batches as the uninterrupted run counts it)."""
        e0, k0, g0 = self._origin
        full, frac = int(math.floor(epochs)), epochs - math.floor(epochs)
        total = step - k0
        total += sum(self.steps_in_epoch(e) for e in range(e0, full))
        if frac > 0 and e0 <= full:
            std = self.sampler.steps_in_epoch(full) if self.token_budget else self._steps
            want = math.ceil(frac * std)
            if e0 < full:
                total += want
            else:
                left = max(0, want * self._units_per_step() - g0)
                total += min(self.steps_in_epoch(e0), k0 + math.ceil(left / self._units_per_step()))
        return max(total, step)

    def left_out_note(self, n_samples: int) -> Optional[str]:
        """The log line naming the training samples an epoch leaves out (None when every sample is trained).

        Fixed batches: each epoch trains ``steps x batch_size x grad_accum x processes`` samples of its
        permutation (reshuffled per epoch), so the same count, but other samples, are left out every epoch.
        Token budget: every sample is in a batch, but the batch count is cut to a multiple of ``processes x
        grad_accum``; the samples of the cut batches differ per epoch, counted here for the first epoch."""
        if self.token_budget:
            kept = sum(len(b) for b in self.sampler.epoch_batches(0))
            left = n_samples - kept
            if left <= 0:
                return None
            return (
                f"train.batch_tokens: {left} of {n_samples} training samples are left out of the first epoch "
                f"(their batches do not fill a last optimizer step: processes x grad_accum = {self.world * self.accum} "
                f"batches); the count and which samples differ per epoch (the batches are re-planned)"
            )
        left = n_samples - self._steps * self.samples_per_step
        if left <= 0:
            return None
        return (
            f"{left} of {n_samples} training samples per epoch do not fill a last optimizer step (batch_size x "
            f"grad_accum x processes = {self.samples_per_step} samples) and are left out of that epoch; the order "
            f"is reshuffled each epoch, so other samples are left out each time"
        )

    def iterate(self, epoch: int, step_in_epoch: int):
        """Micro-batches of this rank from optimizer step ``step_in_epoch`` of ``epoch`` on."""
        self.sampler.set_epoch(epoch)
        g = self._units_before(epoch, step_in_epoch)
        self.sampler.set_start_batch(g) if self.token_budget else self.sampler.set_start(g)
        return iter(self.loader)


# ---------------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------------
def _horizon_after_resume(
    data: _TrainData,
    state: dict,
    d: Dist,
    t,
    total_steps: int,
    horizon: Optional[int],
    scheduler,
) -> int:
    """The step horizon of a run resumed on another number of processes than the checkpoint's: the
    rest of the resumed epoch is dealt out to the new ranks (:class:`_TrainData`), so ``train.epochs``
    ends after a different step count than either process count alone gives; the LR schedule's
    horizon follows. Unchanged process count: ``total_steps`` as computed."""
    if int(state.get("world_size", d.world)) == d.world:
        return total_steps
    from eagle3.train.schedule import WarmupCosine, warmup_steps_for

    new = data.resumed_total_steps(t.epochs, int(state["step"]))
    if horizon is not None:
        new = min(new, horizon)
    if (
        new != total_steps
    ):  # every rank re-stretches it (DDP replicas step with one lr); rank 0 says so
        if d.is_main:
            log.info(
                "resumed on %d processes (checkpoint: %s): %d optimizer steps in all",
                d.world,
                state.get("world_size"),
                new,
            )
        scheduler.lr_lambdas[0].__dict__.update(
            WarmupCosine(warmup_steps_for(new, t.warmup_ratio), new).__dict__
        )
    return new


def _autocast_dtype(cfg: RunConfig, device: torch.device) -> Optional[torch.dtype]:
    if device.type != "cuda":
        if cfg.train.bf16 == "on":
            log.warning(
                "train.bf16=on ignored: bf16 autocast is used on GPU only (CPU trains in float32)"
            )
        return None
    return torch.bfloat16 if cfg.train.bf16 in ("auto", "on") else None


def _data_order(cfg: RunConfig) -> dict:
    """The settings that fix the batch order and the optimizer-step count of an epoch (checkpoint key
    ``data_order``; :func:`eagle3.train.checkpoint.check_data_order`). ``batch_size`` is recorded as None when
    ``batch_tokens`` is set (it is ignored then)."""
    t = cfg.train
    return {
        "train.seed": t.seed,
        "train.batch_tokens": t.batch_tokens,
        "train.batch_size": None if t.batch_tokens is not None else t.batch_size,
        "train.grad_accum": t.grad_accum,
    }


def _recipe(cfg: RunConfig) -> dict:
    """The training recipe a checkpoint records (key ``recipe``, dotted config keys): what
    :func:`eagle3.train.checkpoint.check_recipe` compares on ``--resume``, naming the fields that differ."""
    t = cfg.train
    out = {
        f"train.{k}": getattr(t, k)
        for k in (
            "ttt_length",
            "step_weight",
            "loss",
            "lk_eta",
            "lr",
            "weight_decay",
            "warmup_ratio",
            "epochs",
            "max_steps",
            "grad_clip",
        )
    }
    out["extract.max_length"] = cfg.extract.max_length
    return out


def _data_inputs(split: dict, vocab: dict, data_config: dict) -> dict:
    """What a checkpoint records of the data it was trained on (key ``data_inputs``; compared on ``--resume`` by
    :func:`eagle3.train.checkpoint.data_inputs_problem`): the content sha256 of 03's ``split`` and ``vocab`` map, and
    the aux layers and verifier weights fingerprint (``verifier_weights``; None when 02 recorded none) of the shards'
    ``data_config``."""
    return {
        ckpt.SPLIT_FILE: ckpt.split_sha256(split),
        ckpt.VOCAB_FILE: ckpt.vocab_sha256(vocab),
        ckpt.AUX_LAYERS: [int(i) for i in data_config["aux_layers"]],
        ckpt.VERIFIER_WEIGHTS: data_config.get(ckpt.VERIFIER_WEIGHTS),
    }


def _resume_current(cfg: RunConfig, args, split: dict, vocab: dict, data_config: dict) -> dict:
    """The run now, as :func:`eagle3.train.checkpoint.check_resume` compares it with a checkpoint: ``drafter_args``,
    ``data_order``, ``recipe``, ``data_inputs``."""
    return {
        "drafter_args": dataclasses.asdict(args),
        "data_order": _data_order(cfg),
        "recipe": _recipe(cfg),
        "data_inputs": _data_inputs(split, vocab, data_config),
    }


def _fingerprint(cfg: RunConfig, args) -> str:
    t = cfg.train
    keep = {
        k: getattr(t, k)
        for k in (
            "ttt_length",
            "step_weight",
            "lr",
            "weight_decay",
            "warmup_ratio",
            "epochs",
            "batch_size",
            "grad_accum",
            "grad_clip",
            "seed",
        )
    }
    if (
        t.loss != "soft_ce"
    ):  # recorded only when set, so that fingerprints of earlier runs stay what they were
        keep.update(loss=t.loss, lk_eta=t.lk_eta)
    return ckpt.config_fingerprint(
        {
            "train": keep,
            "drafter": args.to_json(),  # num_layers only when > 1
            "max_length": cfg.extract.max_length,
        }
    )


def _move_batch(batch: dict, device: torch.device, float_dtype: torch.dtype) -> dict:
    """Copy a collated batch to ``device``; fp8 features (+ scales) are dequantised there, after the copy."""
    nb = device.type == "cuda"
    out = {}
    for k, v in batch.items():
        v = v.to(device, non_blocking=nb)
        if v.is_floating_point() and not is_fp8(v) and not k.endswith("_scale"):
            v = v.to(float_dtype)
        out[k] = v
    return dequantize_batch(out, float_dtype)


def run(
    cfg: RunConfig,
    resume: bool = False,
    max_steps: Optional[int] = None,
    stop_after: Optional[int] = None,
    device: Optional[str] = None,
    export: Optional[Callable[[RunConfig, Any, dict], Path]] = None,
    init: Optional[Callable[[RunConfig, torch.Tensor, dict], nn.Module]] = None,
    stop_at: Optional[int] = None,
) -> dict:
    """Train (or continue training) the drafter described by ``cfg``; see the module docstring.

    Args:
        cfg: the run config (``train``, ``drafter``, ``export`` sections; paths from ``cfg``).
        resume: continue from the newest complete checkpoint in ``{train_dir}/checkpoints``
            (starts fresh, with a warning, when there is none). Without ``resume`` an existing
            checkpoint folder is an error (so a finished run is never silently overwritten).
        max_steps: overrides ``train.max_steps``: a cap on the optimizer steps of ``train.epochs`` (schedule
            horizon and end); a value above them is logged as a warning and changes nothing.
        stop_after: stop after this many optimizer steps *in this call*, with a checkpoint, without
            changing the schedule (time-sliced / preemptible jobs; tests).
        stop_at: end the run at this optimizer step, before the schedule's last (``04_train.py --stop-at``): the lr
            follows the whole schedule (``total_steps``) up to it, and the run ends there as a finished run does
            (final validation, ``train.select_best``, export, report) with a checkpoint ``--resume`` can continue
            from. Reproduces a run stopped early on a longer schedule (lease 2026-12-04e's drafter: step 6,000 of
            7,986). Raises UserError when it is not before ``total_steps`` or a resumed checkpoint is already there.
        device: ``"cpu"`` to force CPU.
        export: called as ``export(cfg, drafter, data_config, provenance=...)`` on rank 0 when training finishes
            (not when stopped early), before the report (``provenance``: :func:`export_provenance`); returns the
            export folder. ``04_train.py`` passes
            :func:`eagle3.stages.export.export_for_run`; None = no export (stage 04 never imports
            the later export package).
        init: with ``train.init_from``, called as ``init(cfg, embed_weight [V, H], data_config)`` on every rank and
            returns the drafter in that folder (``04_train.py`` passes
            :func:`eagle3.stages.export.load_init_drafter`); its trainable tensors start the run
            (:func:`warm_start`).

    Returns:
        dict: ``step``, ``total_steps``, ``stopped`` (True when interrupted by a signal or
        ``stop_after``), ``signal`` (the signal number this rank received, else None), ``checkpoint`` (path of the last one written or loaded), ``export_dir``
        (None when stopped early), ``final_val`` (validation metrics) and measured ``tokens_per_s``.

    Raises:
        UserError: bad inputs (missing/corrupt data files, shape mismatches, resume of a different
            drafter shape, existing checkpoints without ``resume``); a full disk (its line ends with
            :data:`REDO_HINT`: re-run with ``--resume``).
    """
    d = init_distributed(device)
    stop = StopFlag()
    from eagle3.io import rerun_hint
    from eagle3.sdpa import no_cudnn_sdpa

    with process_group_scope(
        d.ctrl_group, owned=d.initialized_here
    ):  # barrier only when _run finished
        try:  # no per-shape cuDNN plans (~40 ms each): batch shapes change every step
            with no_cudnn_sdpa(), rerun_hint(REDO_HINT):
                return _run(cfg, d, stop, resume, max_steps, stop_after, export, init, stop_at)
        finally:
            stop.restore()


TRAIN_LOCK = (
    ".train.lock"  # in train_dir while a 04 trains or exports there (one 04 per train folder)
)
#: 04's disk-full advice (:func:`eagle3.io.rerun_hint`): the same command without --resume refuses the checkpoints.
REDO_HINT = "re-run the same command with --resume (04 continues from the newest checkpoint)"


def train_lock_holder(train_dir: Path) -> str:
    """What a second 04 is told when ``{train_dir}/.train.lock`` is held (training and ``--export-only`` both hold
    it): the text after ``<lock>: `` in its one-line error."""
    return f"another 04_train run is training or exporting in {train_dir}; wait for it to end (or stop it) before this one"


@contextlib.contextmanager
def _train_lock(train_dir: Path, d: Dist, field: str = "train.output_dir"):
    """Hold ``{train_dir}/.train.lock`` (:func:`eagle3.io.exclusive_lock`, rank 0) for the whole of 04: a second 04 on
    the same train folder (``--resume`` started while the first still ran) trained beside it, deleting its
    in-flight checkpoint temp files, appending a second copy of every metrics row and writing the same export
    (fresh-user trial 2026-12-05d); now it stops at once with one line on every rank. The folders this call created
    are removed again when the block fails and leaves them empty (a refused run leaves nothing behind)."""
    from eagle3.io.lock import exclusive_lock

    created = [p for p in (train_dir, *train_dir.parents) if not p.exists()]  # deepest first
    holder = train_lock_holder(train_dir)
    with contextlib.ExitStack() as stack:
        failed = None
        if d.is_main:
            try:
                make_dirs(train_dir, field)
                stack.enter_context(exclusive_lock(train_dir / TRAIN_LOCK, holder))
            except UserError as e:
                failed = e
        if _any_rank(failed is not None, d):
            raise failed or UserError(f"{train_dir / TRAIN_LOCK}: {holder}")
        try:
            yield
        except BaseException:
            stack.close()  # the lock file goes first, then the folders this call made, if empty
            with contextlib.suppress(OSError):
                for folder in created if d.is_main else ():
                    folder.rmdir()
            raise


def _run(
    cfg: RunConfig,
    d: Dist,
    stop: StopFlag,
    resume: bool,
    max_steps: Optional[int],
    stop_after: Optional[int],
    export: Optional[Callable] = None,
    init: Optional[Callable] = None,
    stop_at: Optional[int] = None,
) -> dict:
    """The stage in named steps: inputs (+ folder check, warm start), data, optimisation, resume, loop, end. 04's lock
    (:func:`_train_lock`) is taken once the inputs are read and checked, before the first write, and held to the end.
    A refusal before the loop (any UserError of the steps up to the resume), or a signal then
    (:func:`stop_before_training`), removes what this call created. First of all the torchrun ranks compare their
    config and flags (:func:`_ranks_agree`)."""
    _ranks_agree(
        cfg,
        d,
        {
            "--resume": resume,
            "--max-steps": max_steps,
            "--stop-at": stop_at,
            "stop_after": stop_after,
        },
    )
    with contextlib.ExitStack() as held:
        return _run_locked(
            cfg,
            d,
            stop,
            resume,
            max_steps,
            stop_after,
            export,
            init,
            stop_at,
            lock=lambda: held.enter_context(
                _train_lock(cfg.train_dir, d, cfg.output_field("train"))
            ),
        )


def _run_locked(
    cfg: RunConfig,
    d: Dist,
    stop: StopFlag,
    resume: bool,
    max_steps: Optional[int],
    stop_after: Optional[int],
    export: Optional[Callable],
    init: Optional[Callable],
    stop_at: Optional[int],
    lock: Callable[[], None],
) -> dict:
    """:func:`_run`'s steps; ``lock()`` takes 04's lock (called by :func:`_load_inputs` before its first write). Every
    warning logged meanwhile (rank 0) is listed in ``train_report.json`` ``warnings`` (:func:`_collect_warnings`)."""
    with _collect_warnings(d.is_main) as warned:
        warn_world_size(cfg, d)
        with _undo_on_refusal(cfg.train_dir, d.is_main):
            inputs = _load_inputs(cfg, d, resume, init, stop, lock)
            try:
                _same_data(cfg, inputs, d)
                data = _build_data(cfg, d, inputs, max_steps)
                stop_before_training(stop, d)
                run_ = _Training(
                    cfg,
                    d,
                    inputs,
                    data,
                    _build_optimisation(cfg, d, inputs, data.total_steps),
                    warned,
                )
                if resume:
                    run_.restore(stop_at)
                else:
                    run_.set_stop_at(stop_at)
                stop_before_training(stop, d)  # a signal during start-up: no resume line, no step
                run_.announce_resume()
            except BaseException:
                inputs.states.close()
                raise
        try:
            run_.loop(stop, stop_after)
            return run_.finish(stop, export)
        finally:
            inputs.states.close()


class _WarningLines(logging.Handler):
    """A logging handler that lists the messages of WARNING records and above, each text once (in ``lines``)."""

    def __init__(self, lines: list[str]):
        super().__init__(level=logging.WARNING)
        self.lines = lines

    def emit(self, record: logging.LogRecord) -> None:
        try:
            msg = (
                record.getMessage()
            )  # formatted now: a logged dict changed later keeps the text that was shown
        except Exception:  # noqa: BLE001 - a bad log call must not stop training
            return
        if msg not in self.lines:
            self.lines.append(msg)


@contextlib.contextmanager
def _collect_warnings(enabled: bool):
    """Within the block, every warning logged by an ``eagle3`` logger (the trainer's, the checkpoint loader's, the
    schedule's on a resume, ...) is appended to the yielded list, once per text: ``train_report.json``'s
    ``warnings``. Before, only the few a call site also appended there were listed, so a resume's warnings (an unusable
    newest checkpoint skipped, the lr schedule re-stretched, RNG states reseeded) were in the log only.

    Args:
        enabled: collect (rank 0, which writes the report); else the list stays empty.
    """
    lines: list[str] = []
    handler = _WarningLines(lines) if enabled else None
    target = logging.getLogger("eagle3")
    if handler is not None:
        target.addHandler(handler)
    try:
        yield lines
    finally:
        if handler is not None:
            target.removeHandler(handler)


@contextlib.contextmanager
def _undo_on_refusal(train_dir: Path, enabled: bool):
    """Around 04's setup steps (inputs, data, optimisation, resume; nothing of the loop): on a UserError (or a signal:
    ``KeyboardInterrupt``, :func:`stop_before_training`), remove what
    this call created before the refusal, i.e. ``{train_dir}/target_head.safetensors`` when it was not there before
    and ``train_dir`` itself when this call made it and it is empty again. Files an earlier run made are kept.
    ``enabled``: rank 0 (the rank that writes).

    Raises:
        the UserError / KeyboardInterrupt, unchanged.
    """
    head = Path(train_dir) / TARGET_HEAD_FILE
    had_dir, had_head = Path(train_dir).exists(), head.exists()
    try:
        yield
    except (
        UserError,
        KeyboardInterrupt,
    ):  # a refusal, or a signal before the first step (stop_before_training)
        if enabled:
            if not had_head:
                with contextlib.suppress(
                    OSError
                ):  # train_dir a file (the refusal says so): nothing to remove
                    head.unlink(missing_ok=True)
            if not had_dir:
                with contextlib.suppress(OSError):  # not empty: something else is in it, keep it
                    Path(train_dir).rmdir()
        raise


def _check_train_dir(
    cfg: RunConfig, d: Dist, resume: bool, current: Optional[Callable[[], dict]] = None
) -> None:
    """Folder step (after the inputs are read, before anything is written): refuse existing checkpoints without
    ``resume`` (:func:`without_resume_refusal`: the advice depends on whether ``--resume`` would take them, judged
    against ``current()``, :func:`_resume_current`, called only then); drop stale temp files of an interrupted run.

    Raises:
        UserError: checkpoints in the folder and no ``resume``.
    """
    train_dir = cfg.train_dir
    if ckpt.list_checkpoints(train_dir) and not resume:
        raise UserError(without_resume_refusal(cfg, current() if current is not None else None))
    if d.is_main and train_dir.is_dir():
        ckpt.remove_stale_tmp(train_dir)


def without_resume_refusal(cfg: RunConfig, current: Optional[dict]) -> str:
    """The one line refusing a 04 without ``--resume`` in a train folder that holds checkpoints. It advised
    ``pass --resume`` also when that resume would be refused (other drafter shape, batching, loss, split, vocab map,
    aux layers or verifier weights than the checkpoint's; files none of which loads), so the advice cost one more
    refused run. The resume's checks (:func:`eagle3.train.checkpoint.find_latest_checkpoint` and
    :func:`eagle3.train.checkpoint.check_resume` against ``current``, :func:`_resume_current`; None: not judged) now
    run first: when they pass, ``pass --resume to continue`` (naming the step a resume takes when the newest file does
    not load); when they fail, why, and what 04 offers instead (a new ``train.output_dir``, or deleting the checkpoints
    folder: 04 has no ``--overwrite``). The step horizon (a checkpoint past the run's end) is checked by the resume
    itself, later.
    """
    where = ckpt.ckpt_dir(cfg.train_dir)
    existing = ckpt.list_checkpoints(cfg.train_dir)
    head = f"{where}: holds checkpoints (newest step {existing[-1][0]})"
    if current is None:
        return f"{head}; pass --resume to continue, or set train.output_dir to a new folder"
    try:
        path, state = ckpt.find_latest_checkpoint(cfg.train_dir, warn=False)
        ckpt.check_resume(path, state, current, cfg.data_dir)
    except UserError as e:
        return (
            f"{head}, and --resume would refuse them: {e}; so train into a new folder (--set "
            f"train.output_dir=...), or delete {where} to start this one over (04 has no --overwrite)"
        )
    older = (
        ""
        if int(state["step"]) == existing[-1][0]
        else f" from step {state['step']}, the newest that loads"
    )
    return f"{head}; pass --resume to continue{older}, or set train.output_dir to a new folder"


@dataclass
class _Inputs:
    """What the inputs step fixes: metadata, vocab map, split, drafter shape and init, the verifier head on the
    device (``head_lm`` ``[V, Ht]``, ``head_norm`` ``[Ht]`` or None when the last state is post-norm), the
    autocast and feature dtypes, and the source of the hidden states (:mod:`eagle3.train.online`)."""

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
    init_from: Optional[str] = (
        None  # the train.init_from this call warm-started from (None: cold or resumed)
    )


def warm_start(drafter: nn.Module, src: nn.Module, source: str) -> dict:
    """Copy ``src``'s trainable tensors into ``drafter`` (in place; ``train.init_from``'s warm start).

    Both are :class:`eagle3.drafter.model.Eagle3Drafter`; ``drafter`` is this run's freshly initialised one (its
    frozen ``embed_tokens``, its vocab map and so its ``lm_head`` rows = the verifier's rows of its draft ids stay
    where ``src`` has nothing for them). Every trainable tensor of ``drafter`` but ``lm_head.weight`` must exist in
    ``src`` with the same shape, and ``src``'s trainable set must hold nothing else; the variant and the target vocab
    must be equal. ``lm_head.weight`` (``[draft_V, H]``) is copied by target token: row ``i`` names target
    ``i + d2t[i]`` (FIELD-NOTES section 3), so under another stage-03 map (other data, another
    ``data.draft_vocab_size``) each of this run's draft tokens that ``src`` also drafts gets ``src``'s row for that
    token, and the others keep their verifier init. Under the same map that is a plain copy.

    Returns:
        ``{"tensors": copied tensors, "lm_head_rows": this run's draft_V, "lm_head_rows_copied": rows from src}``.

    Raises:
        UserError: naming ``source`` and the first difference (variant, target vocab, a missing / extra /
            misshapen tensor).
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
        cut = (
            1 if name == "lm_head.weight" else 0
        )  # lm_head: rows per draft vocab (moved below), width must match
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
    dv_new, dv_old = drafter.d2t.numel(), src.d2t.numel()
    tgt_new = (
        torch.arange(dv_new) + drafter.d2t.cpu()
    )  # [dV] target id of each of this run's draft ids
    tgt_old = torch.arange(dv_old) + src.d2t.cpu()  # [dV_src]
    row_of = torch.full(
        (int(drafter.args.target_vocab_size),), -1, dtype=torch.long
    )  # [V] src draft id per target
    row_of[tgt_old] = torch.arange(dv_old)
    src_rows = row_of[tgt_new]  # [dV] -1 where src does not draft that token
    hit = src_rows >= 0  # [dV]
    with torch.no_grad():
        for name, p in mine.items():
            if name == "lm_head.weight":
                p[hit.to(p.device)] = theirs[name][src_rows[hit]].to(
                    p.device, p.dtype
                )  # [n_hit, H]
            else:
                p.copy_(theirs[name].to(p.device, p.dtype))
    return {"tensors": len(mine), "lm_head_rows": dv_new, "lm_head_rows_copied": int(hit.sum())}


# DrafterArgs fields that fix the shape of a trainable tensor (or, variant, which tensors exist): a warm start needs
# them equal; draft_vocab_size may differ (lm_head rows move by target token), the rest (norm eps, rope, context) shape
# nothing
_WARM_START_SHAPE = (
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


def check_init_from_shape(src: str, exported: dict, args) -> None:
    """Refuse a ``train.init_from`` export whose drafter shape differs from the one this run trains, before anything
    is written (the full tensor check of :func:`warm_start` runs later, after the verifier head is extracted).

    Args:
        src: the export folder (for the message).
        exported: the export's ``drafter_args`` (``eagle3_train.json``; absent keys take DrafterArgs' defaults:
            ``variant`` eagle3 and ``num_layers`` 1 for exports written before those fields existed).
        args: this run's :class:`eagle3.drafter.model.DrafterArgs`.

    Raises:
        UserError: naming the first differing field, e.g. ``train.init_from: 'x/drafter-sglang' holds a drafter with
            num_layers 1, this run trains 2 (drafter.num_layers)``.
    """
    _check_shape_fields(src, exported, {key: getattr(args, key) for key in _WARM_START_SHAPE})


def _check_shape_fields(src: str, exported: dict, mine: dict) -> None:
    """The first field of ``mine`` (shape field -> this run's value; None = not known yet) that differs from the
    export's ``drafter_args`` (absent ``variant`` / ``num_layers``: the DrafterArgs defaults eagle3 / 1); UserError."""
    from eagle3.config.drafter import DrafterConfig

    have = {"variant": "eagle3", "num_layers": 1, **exported}
    for key, b in mine.items():
        if (
            key not in have or b is None
        ):  # not recorded (left to warm_start's tensor-by-tensor check) or not known
            continue
        a = have[key]
        if a != b:
            where = (
                f"drafter.{key}"
                if key in DrafterConfig.model_fields
                else "from the verifier and its shards"
            )
            raise UserError(
                f"train.init_from: '{src}' holds a drafter with {key} {a!r}, this run trains {b!r} ({where})"
            )


def check_init_from_config(cfg: RunConfig) -> bool:
    """The part of the warm-start checks that needs neither the verifier nor the shards: ``train.init_from`` is an
    export folder (``config.json`` + ``model.safetensors``) and the drafter shape fields the config itself fixes
    (``drafter.*`` not null: ``variant``, ``num_layers``, ``intermediate_size``, ...) equal the export's recorded
    ``drafter_args`` (``eagle3_train.json``). 04 checks the full shape (fields taken from the verifier included)
    later, before its first write; a lease driver runs this at its start (``bench/lease_preflight.py``), minutes
    before 04 would (lease 2026-12-05b: a one-layer export under a config that had become two-layer).

    Returns:
        whether a warm start is configured (``train.init_from`` set).

    Raises:
        UserError: the folder missing or not an export, or a differing field (as :func:`check_init_from_shape`).
    """
    src = cfg.train.init_from
    if not src:
        return False
    exported = _exported_drafter_args(src)
    if exported is not None:
        _check_shape_fields(
            src, exported, {k: getattr(cfg.drafter, k, None) for k in _WARM_START_SHAPE}
        )
    return True


def init_from_not_a_folder(path: Path) -> UserError:
    """The error for a ``train.init_from`` that is no folder: missing, or a file (a checkpoint ``step_*.pt`` or a
    ``model.safetensors`` given for its folder: it said "folder not found" of a file that exists, fresh-user trial
    2026-12-05d)."""
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


def _exported_drafter_args(src: str) -> Optional[dict]:
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
    from eagle3.io import read_json

    meta = read_json(path / EXPORT_META_FILE)
    exported = meta.get("drafter_args") if isinstance(meta, dict) else None
    return exported if isinstance(exported, dict) else None


def _warm_start_planned(cfg: RunConfig, d: Dist, resume: bool, args=None) -> bool:
    """Whether this call warm-starts from ``train.init_from``: set, and no ``--resume`` checkpoint to continue (that
    one holds the run's weights, the warm start's included). Checks, before anything is written, that the folder
    looks like an export (``config.json`` + ``model.safetensors``) and, given this run's drafter ``args``, that the
    export's recorded drafter shape is the same (:func:`check_init_from_shape`).

    Raises:
        UserError: ``train.init_from: folder ... not found`` / ``... is not an exported drafter folder`` / a shape
            field that differs.
    """
    src = cfg.train.init_from
    if not src:
        return False
    if resume and ckpt.list_checkpoints(cfg.train_dir):
        if d.is_main:
            log.info(
                "train.init_from (%s) not used: --resume continues from the run's checkpoint", src
            )
        return False
    exported = _exported_drafter_args(src)
    if args is not None and exported is not None:
        check_init_from_shape(src, exported, args)
    return True


def _load_inputs(
    cfg: RunConfig,
    d: Dist,
    resume: bool,
    init: Optional[Callable] = None,
    stop: Optional[StopFlag] = None,
    lock: Optional[Callable[[], None]] = None,
) -> _Inputs:
    """Inputs step: ``data_config.json``, vocab map, split, drafter args (all read and checked before anything
    is written, so a bad input is the first error and leaves no empty train/ folder behind), the folder check,
    verifier head, drafter init, and the hidden-state source (shards, or the verifier / capture servers for
    ``train.hidden_states: online``). A signal (``stop``) is honoured between these (:func:`stop_before_training`)."""
    from eagle3.train.online import check_hidden_states, state_source, unused_shard_states_note

    data_config = read_data_config(cfg.shards_dir)
    unchecked = check_verifier(
        cfg.verifier, data_config, cfg.shards_dir
    )  # first: another verifier explains the rest
    if (
        unchecked and d.is_main
    ):  # weights not comparable (shards without a fingerprint): train_report's warnings too
        log.warning("%s", unchecked)
    check_extract_settings(cfg.extract, data_config, cfg.shards_dir)
    check_servable(
        data_config["aux_layers"],
        cfg.export.engine,
        str(data_config["architecture"]),
        str(cfg.shards_dir / "data_config.json"),
    )  # before training, not at the export after it
    check_hidden_states(cfg, data_config)
    vocab = load_run_vocab_map(cfg, int(data_config["vocab_size"]))
    split = read_split(cfg.data_dir)
    # 03's last validation of these shards passed, and its split and vocab map were made from them under the
    # config's data: settings, else UserError
    require_current(
        cfg.data_dir,
        cfg.shards_dir,
        data_settings(cfg.data),
        require_passed(cfg.shards_dir, cfg.data_dir),
    )
    args = build_drafter_args(cfg, data_config, vocab)
    if args.hidden_size != int(
        data_config["hidden_size"]
    ):  # init_drafter's check, before the head is extracted
        raise UserError(
            f"drafter.hidden_size: {args.hidden_size} differs from the verifier hidden size "
            f"{data_config['hidden_size']} ({cfg.shards_dir / 'data_config.json'}); the drafter reuses "
            f"the verifier's token embedding: set drafter.hidden_size: {data_config['hidden_size']} (or "
            f"null, the verifier's)"
        )
    warm = _warm_start_planned(
        cfg, d, resume, args
    )  # checked before the first write (the full check: after the head)
    if lock is not None:
        lock()  # 04's lock on train_dir (_train_lock), before the folder check deletes stale temp files
    # with this run's process count, as the resume compares it (a split keeping the global batch is taken)
    _check_train_dir(
        cfg,
        d,
        resume,
        lambda: {**_resume_current(cfg, args, split, vocab, data_config), "world_size": d.world},
    )
    stop_before_training(stop, d)
    head = prepare_target_head(
        cfg, data_config, d
    )  # the first write: target_head.safetensors (creates train_dir)
    if d.is_main:
        make_dirs(cfg.train_dir, cfg.output_field("train"))
    stop_before_training(stop, d)  # the head's extraction can take minutes (verifier weights)
    drafter = init_drafter(args, head, vocab, cfg.train.seed)
    if warm:
        if init is None:
            raise UserError(
                "train.init_from: needs the export loader that 04_train.py passes (trainer.run(init=...))"
            )
        ws = warm_start(
            drafter, init(cfg, drafter.embed_tokens.weight, data_config), cfg.train.init_from
        )
        if d.is_main:
            moved = ws["lm_head_rows_copied"] < ws["lm_head_rows"]
            log.info(
                "warm start from %s: %d trainable tensors; lm_head %d of %d draft tokens from it%s",
                cfg.train.init_from,
                ws["tensors"],
                ws["lm_head_rows_copied"],
                ws["lm_head_rows"],
                " (another vocab map: the rest keep the verifier's rows)" if moved else "",
            )
    drafter = drafter.to(d.device)
    amp = _autocast_dtype(cfg, d.device)
    feat_dtype = torch.bfloat16 if amp is not None else torch.float32
    inputs = _Inputs(
        data_config=data_config,
        vocab=vocab,
        split=split,
        args=args,
        drafter=drafter,
        amp=amp,
        feat_dtype=feat_dtype,
        head_lm=head.lm_head.to(d.device, feat_dtype),  # [V, Ht]
        head_norm=None
        if head.last_is_post_norm
        else head.norm_weight.to(d.device, feat_dtype),  # [Ht]
        head_eps=float(head.norm_eps),
        d2t=vocab["d2t"].to(d.device),
        t2d=vocab["t2d"].to(d.device),
        states=None,
        init_from=cfg.train.init_from if warm else None,
    )
    del head
    stop_before_training(stop, d)
    unused = unused_shard_states_note(
        cfg, data_config
    )  # online over shards with states: said, not silent
    if unused and d.is_main:
        log.info(unused)
    inputs.states = state_source(
        cfg, data_config, d.device, feat_dtype
    )  # online: loads the verifier
    return inputs


@dataclass
class _Data:
    """What the data step fixes: datasets, the training order of this rank, the step horizon, eval cadence."""

    train_ds: ShardDataset
    val_ds: Optional[ShardDataset]
    order: "_TrainData"
    total_steps: int
    val_lengths: Optional[list[int]]
    eval_every: Optional[
        int
    ]  # train.eval_every; None = at the end of each epoch (:meth:`_Training.eval_due`)
    horizon: Optional[int]  # max_steps / train.max_steps (None = the epochs decide)
    horizon_from: str = (
        "train.epochs"  # what sets total_steps, for messages: "--max-steps N" / "train.max_steps N"
    )


def _build_data(cfg: RunConfig, d: Dist, inputs: _Inputs, max_steps: Optional[int]) -> _Data:
    """Data step: train/val datasets over the shards (items without states when they are computed online),
    the data order (:class:`_TrainData`), total optimizer steps (``max_steps`` / ``train.max_steps`` cap)."""
    t = cfg.train
    expect = expect_from_data_config(inputs.data_config)
    max_len = int(inputs.data_config["max_length"])
    with_states = inputs.states.reads_shard_states
    split_file = cfg.data_dir / "split.json"  # named in a missing-shard error
    train_ds = ShardDataset(
        cfg.shards_dir,
        inputs.split["train"],
        max_len,
        expect,
        "train",
        states=with_states,
        split_file=split_file,
    )
    val_ds = (
        ShardDataset(
            cfg.shards_dir,
            inputs.split["val"],
            max_len,
            expect,
            "val",
            states=with_states,
            split_file=split_file,
        )
        if inputs.split["val"]
        else None
    )
    order = _TrainData(cfg, train_ds, d)
    total_steps = order.total_steps
    horizon = max_steps if max_steps is not None else t.max_steps
    if horizon is not None:
        total_steps = min(total_steps, horizon)
    val_lengths = (
        sample_lengths(cfg.shards_dir, val_ds, max_len)
        if (val_ds is not None and t.batch_tokens)
        else None
    )
    horizon_from = f"train.epochs {t.epochs:g}"
    given = (
        f"--max-steps {max_steps}" if max_steps is not None else f"train.max_steps {t.max_steps}"
    )
    if horizon is not None and horizon < order.total_steps:
        horizon_from = given
    if d.is_main:
        if horizon is not None and horizon > order.total_steps:
            log.warning(
                "%s is more than the %d optimizer steps of train.epochs %g; it only caps that schedule, so the "
                "run ends after %d steps (raise train.epochs for a longer run)",
                given,
                order.total_steps,
                t.epochs,
                order.total_steps,
            )
        note = order.left_out_note(len(train_ds))
        if note:
            log.info(note)
    if val_ds is None and t.select_best == "sim_accept" and d.is_main:
        log.warning(_no_val_selection(cfg))
    elif (
        t.select_best == "sim_accept"
        and val_ds is not None
        and t.eval_every is not None
        and t.eval_every >= total_steps
        and d.is_main
    ):
        log.warning(_no_periodic_validation(t.eval_every, total_steps))
    return _Data(
        train_ds, val_ds, order, total_steps, val_lengths, t.eval_every, horizon, horizon_from
    )


def _no_periodic_validation(eval_every: int, total_steps: int) -> str:
    """The warning of ``train.select_best: sim_accept`` with a ``train.eval_every`` not below the run's optimizer
    steps: the final validation is the only one, so nothing is selected (the run used to say nothing)."""
    return (
        f"train.eval_every {eval_every} is not below the run's {total_steps} optimizer steps: only the final "
        f"validation runs and train.select_best: sim_accept has only that one to select from, so the last step's "
        f"weights are exported (lower train.eval_every, or leave it unset to validate at each epoch's end)"
    )


def _no_val_selection(cfg: RunConfig) -> str:
    """The warning of ``train.select_best: sim_accept`` without a validation split (nothing to select from)."""
    return (
        f"train.select_best: sim_accept has no validation split to select from ({cfg.data_dir / 'split.json'} "
        f"key 'val' is empty: stage 03 ran with data.val_fraction 0); the last step's weights are exported instead"
    )


@dataclass
class _Optimisation:
    objective: "TTTObjective"
    model: nn.Module  # the objective, wrapped in DDP and/or torch.compile
    params: list
    optimizer: torch.optim.Optimizer
    scheduler: Any
    fingerprint: str


def _build_optimisation(
    cfg: RunConfig, d: Dist, inputs: _Inputs, total_steps: int
) -> _Optimisation:
    """Optimisation step: the TTT objective (DDP, torch.compile), AdamW over the trainable drafter
    parameters, the warmup + cosine schedule over ``total_steps``."""
    t = cfg.train
    # Logit checkpointing inside torch.compile(dynamic=True) fails in dynamo on torch 2.11
    # ("lift_tracked_freevar_to_input"), and compiled without it was faster anyway (bench/results).
    # auto = off: the training loss (eagle3/train/ttt_rows.py) keeps only the bf16 logits of the loss rows per TTT
    # step (M x draft_V x 2 bytes; 7 x 1 GB at 16K loss tokens), and recomputing them cost 12% of a
    # SmolLM2 step on the H200 (bench/small_train_speed.py: tokens vs tokens+nock).
    ckpt_logits = t.checkpoint_logits == "on"
    if t.compile and ckpt_logits:
        raise UserError(
            "train.checkpoint_logits: 'on' cannot be combined with train.compile: true (torch.compile "
            "fails on the checkpointed loss); use 'auto' or 'off'"
        )
    objective = TTTObjective(
        inputs.drafter,
        t.ttt_length,
        t.step_weight,
        checkpoint_logits=ckpt_logits,
        loss=t.loss,
        lk_eta=t.lk_eta,
    )
    model = objective
    if d.distributed:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(objective, device_ids=[d.device.index] if d.device.type == "cuda" else None)
    if t.compile:
        # Variable batch lengths: dynamic shapes avoid one recompile per sequence length.
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
    )  # fused kernel: one launch for all params
    scheduler = build_scheduler(optimizer, total_steps, t.warmup_ratio)
    return _Optimisation(
        objective, model, params, optimizer, scheduler, _fingerprint(cfg, inputs.args)
    )


class _Training:
    """One rank's training run after setup: position in the data, metrics window, and the steps of the
    loop as methods (:meth:`restore`, :meth:`loop` -> :meth:`train_step` + :meth:`log_step` +
    :meth:`after_step` (the hooks that run between optimizer steps: validation, checkpoint, stop),
    :meth:`validate`, :meth:`save`, :meth:`finish`)."""

    def __init__(
        self,
        cfg: RunConfig,
        d: Dist,
        inputs: _Inputs,
        data: _Data,
        opt: _Optimisation,
        warnings: Optional[list[str]] = None,
    ):
        self.cfg, self.t, self.d = cfg, cfg.train, d
        self.inputs, self.data, self.opt = inputs, data, opt
        self.train_dir = cfg.train_dir
        self.total_steps = data.total_steps
        self.step, self.epoch, self.step_in_epoch, self.last_ckpt = 0, 0, 0, None
        self.steps_this_call = 0
        self.stop_at: Optional[int] = (
            None  # --stop-at: the run ends here, before total_steps (set_stop_at)
        )
        self.stopped = False
        self.metrics: Optional[_Metrics] = None
        self.tracker = None  # eagle3.train.sim_accept.BestTracker, started with the loop
        # one-line warnings of this call (train_report's key 'warnings'): filled by _collect_warnings, which lists
        # every warning logged
        self.warnings: list[str] = [] if warnings is None else warnings
        self.tok_total, self.t_total = 0.0, 0.0
        # the run's earlier calls (a resumed checkpoint's ``segments``), and the step this call started at
        self.earlier_segments: list[dict] = []
        self.segment_start = 0

    @property
    def end_step(self) -> int:
        """The step this run ends at: ``stop_at`` when set (before the schedule's end), else ``total_steps``."""
        return self.total_steps if self.stop_at is None else self.stop_at

    def set_stop_at(self, stop_at: Optional[int]) -> None:
        """Check and set ``--stop-at`` (from :meth:`restore` when resuming, once ``total_steps`` is known and before
        anything is loaded or logged about the schedule).

        Raises:
            UserError: ``stop_at`` not before the schedule's last step, or before the resumed checkpoint's step (at it:
                a run stopped by a signal on its stop step, resumed with the same command, trains nothing and ends
                there: final validation, export, report).
        """
        if stop_at is None:
            return
        if stop_at >= self.total_steps:
            raise UserError(
                f"--stop-at {stop_at}: the schedule has {self.total_steps} optimizer steps; a stop at or "
                f"after its end is the whole run (leave --stop-at out, or {self._longer_schedule()})"
            )
        if stop_at < self.step:
            raise UserError(
                f"--stop-at {stop_at}: the checkpoint resumed from is at step {self.step}, past it "
                f"(`--export-only` exports it)"
            )
        self.stop_at = stop_at  # == self.step (a run stopped by a signal on its --stop-at step): no step, the end only

    def _longer_schedule(self) -> str:
        """How to get a longer lr schedule, for the --stop-at refusal: raise what sets its end (``train.epochs``, or a
        ``--max-steps`` / ``train.max_steps`` cap below the epochs' steps; ``train.max_steps`` cannot go past them)."""
        t, epochs_steps = self.t, self.data.order.total_steps
        if self.data.horizon is not None and self.data.horizon < epochs_steps:
            name = self.data.horizon_from.split(" ")[0]
            return (
                f"raise {name} (up to the {epochs_steps} steps of train.epochs {t.epochs:g}; beyond that, raise "
                f"train.epochs too)"
            )
        return f"raise train.epochs (now {t.epochs:g}) for a longer schedule"

    def recipe_used(self) -> dict:
        """The recipe of ``train_report.json``: the config's values, except those a resumed checkpoint's optimizer
        state overrides (``lr``: the scheduler's base lr; ``weight_decay``: the optimizer's), i.e. what training used."""
        out = {
            k: getattr(self.t, k)
            for k in (
                "loss",
                "lk_eta",
                "epochs",
                "batch_tokens",
                "batch_size",
                "grad_accum",
                "warmup_ratio",
                "ttt_length",
                "select_best",
            )
        }
        return {**out, **self._optimizer_values()}

    def _optimizer_values(self) -> dict:
        """``lr`` and ``weight_decay`` as the optimizer holds them: a resumed checkpoint's, not the config's
        (:data:`eagle3.train.checkpoint.KEPT_FIELDS`)."""
        return {
            "lr": float(self.opt.scheduler.base_lrs[0]),
            "weight_decay": float(self.opt.optimizer.param_groups[0]["weight_decay"]),
        }

    # ---- resume ------------------------------------------------------------------------------
    def restore(self, stop_at: Optional[int] = None) -> None:
        """Continue from the newest complete checkpoint: weights, optimizer, schedule, data position, RNG.

        Every check comes before anything is loaded or logged about the schedule: the checkpoint against the run
        (:func:`eagle3.train.checkpoint.check_resume`: all refused fields in one line), then the step horizon, then
        ``stop_at`` (:meth:`set_stop_at`; it was checked after the schedule warning, fresh-user trial 2026-12-05e).

        Raises:
            UserError: a refused change (drafter shape, data order, loss definition, split or vocab map), a checkpoint
                already past the run's end, a refused ``stop_at``, or a model state that does not fit.
        """
        t, d, o = self.t, self.d, self.opt
        found = ckpt.find_latest_checkpoint(
            self.train_dir, warn=d.is_main
        )  # every rank loads it; rank 0 says so
        _same_checkpoint(self.train_dir, found, d)
        if found is None:  # no checkpoint file at all (files that all fail to load: UserError)
            self.set_stop_at(stop_at)
            if d.is_main:
                log.warning(
                    "--resume: no checkpoint in %s; starting from step 0",
                    ckpt.ckpt_dir(self.train_dir),
                )
            return
        path, state = found
        i = self.inputs
        current = {
            **_resume_current(self.cfg, i.args, i.split, i.vocab, i.data_config),
            "world_size": d.world,
        }
        changes = ckpt.check_resume(path, state, current, self.cfg.data_dir)
        unchecked = ckpt.data_inputs_unchecked(
            path, state.get("data_inputs"), current["data_inputs"], "--resume"
        )
        self.step, self.epoch = int(state["step"]), int(state["epoch"])
        self.step_in_epoch = self.data.order.step_from_checkpoint(state)
        self.total_steps = _horizon_after_resume(
            self.data.order, state, d, t, self.total_steps, self.data.horizon, o.scheduler
        )
        if (
            self.step > self.total_steps
        ):  # nothing to train, and the end step would be behind the weights
            raise UserError(
                f"{self.data.horizon_from}: the run ends after {self.total_steps} optimizer steps, but the "
                f"checkpoint resumed from ({path}) is at step {self.step} already; ask for more steps, or "
                f"export that checkpoint with --export-only"
            )
        self.set_stop_at(stop_at)
        if (
            changes and d.is_main
        ):  # (in train_report's warnings too, as every warning: _collect_warnings; rank 0's)
            log.warning(
                "%s: resumed from %s with other training settings: %s",
                path,
                path.name,
                "; ".join(changes),
            )
        elif (
            d.is_main
            and state.get("recipe") is None
            and state["config_fingerprint"] != o.fingerprint
        ):  # unknown
            log.warning(
                "%s: training settings differ from the checkpoint's (fingerprint %s != %s)",
                path,
                state["config_fingerprint"],
                o.fingerprint,
            )
        if unchecked and d.is_main:  # (train_report's warnings too)
            log.warning("%s", unchecked)
        self._load_state(path, state)
        rngs = state["rng"]
        if len(rngs) == d.world:
            ckpt.restore_rng(rngs[d.rank])
        else:
            if d.is_main:
                log.warning(
                    "%s: saved with %d processes, now %d; RNG states reseeded",
                    path,
                    len(rngs),
                    d.world,
                )
            torch.manual_seed(t.seed + 1000 * self.step + d.rank)
        self.last_ckpt = path
        self.earlier_segments, self.segment_start = earlier_segments(state), self.step
        switch = state_source_switch(path, self.earlier_segments, self.current_segment())
        if switch and d.is_main:
            log.warning("%s", switch)

    def announce_resume(self) -> None:
        """Log where a resumed run stands (rank 0), once every setup check (``--stop-at`` included) has passed."""
        if self.last_ckpt is not None and self.d.is_main:
            log.info("resumed from %s (%s)", self.last_ckpt, self._position())

    def _position(self) -> str:
        """Where a resumed run stands, for its log line: ``step 2, at the end of epoch 1`` or ``step 3, epoch 2,
        1 step into it`` (epochs counted from 0, as in ``metrics.jsonl``)."""
        k = self.step_in_epoch
        if k >= self.data.order.steps_in_epoch(self.epoch):
            return f"step {self.step}, at the end of epoch {self.epoch}"
        return f"step {self.step}, epoch {self.epoch}, {k} step{'' if k == 1 else 's'} into it"

    def _load_state(self, path: Path, state: dict) -> None:
        """Load a checked checkpoint's weights, optimizer and scheduler (keeping this run's schedule horizon, set by
        :meth:`restore`) and its warm-start record.

        Raises:
            UserError: the checkpoint's ``model`` misses trainable tensors or has unexpected ones.
        """
        o, drafter = self.opt, self.inputs.drafter
        missing, unexpected = drafter.load_state_dict(state["model"], strict=False)
        want = {n for n, p in drafter.named_parameters() if p.requires_grad}
        lost = sorted(want & set(missing))
        if lost or unexpected:
            raise UserError(
                f"{path}: key 'model': missing {lost[:3]} unexpected {list(unexpected)[:3]}"
            )
        o.optimizer.load_state_dict(state["optimizer"])
        horizon_now = o.scheduler.lr_lambdas[0].__dict__.copy()  # this run's warmup/total steps
        o.scheduler.load_state_dict(state["scheduler"])
        if o.scheduler.lr_lambdas[0].__dict__ != horizon_now:
            if self.d.is_main:  # every rank re-stretches it; rank 0 says so once
                log.warning(
                    "%s: LR schedule %s in the checkpoint, now %s (%s); continuing with the new one",
                    path,
                    o.scheduler.lr_lambdas[0].__dict__,
                    horizon_now,
                    self._horizon_reason(state),
                )
            o.scheduler.lr_lambdas[0].__dict__.update(horizon_now)
        self.inputs.init_from = state.get(
            "init_from"
        )  # the run's warm start, recorded by its first call

    def _horizon_reason(self, state: dict) -> str:
        """Why a resumed run's lr schedule differs from its checkpoint's, for the warning: the schedule keys changed in
        the config (``train.epochs`` / ``train.max_steps`` / ``--max-steps``, ``train.warmup_ratio``) and/or another
        process count (the steps of ``train.epochs`` follow the new split). It said "max_steps/epochs changed" also when
        only the process count had (fresh-user trial 2026-12-05d)."""
        saved, now = state.get("recipe") or {}, _recipe(self.cfg)
        keys = [
            k
            for k in ("train.epochs", "train.max_steps", "train.warmup_ratio")
            if k in saved and saved[k] != now[k]
        ]
        why = [f"{k} {ckpt.as_written(k, saved[k])} -> {ckpt.as_written(k, now[k])}" for k in keys]
        then = state.get("world_size")
        if then is not None and int(then) != self.d.world:
            why.append(
                f"{then} processes then, {self.d.world} now: the steps of train.epochs follow the new split"
            )
        return "; ".join(why) or "--max-steps, train.max_steps or train.epochs changed"

    def recipe_in_use(self) -> dict:
        """The recipe a checkpoint records (key ``recipe``): the config's, except the fields a resumed checkpoint's
        optimizer state keeps (:data:`eagle3.train.checkpoint.KEPT_FIELDS`), which are the values in use; so a later
        ``--resume`` with the run's original config warns about nothing."""
        return {
            **_recipe(self.cfg),
            **{f"train.{k}": v for k, v in self._optimizer_values().items()},
        }

    def current_segment(self) -> dict:
        """This call's part of the run (:func:`segment_record`): from the step it started at to the current step."""
        return segment_record(
            self.segment_start,
            self.step,
            self.t.hidden_states,
            self.cfg.extract.backend,
            self.d.world,
            (self.tok_total / self.t_total) if self.t_total > 0 else None,
            _peak_gpu_mem_gib(self.d.device),
            self.warnings,
        )

    def segments(self) -> list[dict]:
        """The run's parts, one per 04 call that trained (a resumed checkpoint's earlier ones, then this call's; parts
        without a step left out): checkpoint and ``train_report.json`` key ``segments``."""
        return [
            g
            for g in [*self.earlier_segments, self.current_segment()]
            if g["end_step"] > g["start_step"]
        ]

    def save(self) -> Path:
        """Checkpoint at the current step (every rank's RNG gathered; rank 0 writes)."""
        d, o = self.d, self.opt
        rng = ckpt.capture_rng()
        rngs = [None] * d.world
        if d.distributed:
            dist.all_gather_object(rngs, rng, group=d.ctrl_group)
        else:
            rngs = [rng]
        path = ckpt.ckpt_path(self.train_dir, self.step)
        if d.is_main:
            path = ckpt.save_checkpoint(
                self.train_dir,
                {
                    "step": self.step,
                    "epoch": self.epoch,
                    "steps_in_epoch": self.step_in_epoch,
                    "samples_in_epoch": self.data.order.samples_before(
                        self.epoch, self.step_in_epoch
                    ),
                    "model": trainable_state(self.inputs.drafter),
                    "optimizer": o.optimizer.state_dict(),
                    "scheduler": o.scheduler.state_dict(),
                    "rng": rngs,
                    "drafter_args": self.inputs.args.to_json(),
                    "config_fingerprint": o.fingerprint,
                    "world_size": d.world,
                    "data_order": _data_order(self.cfg),
                    "init_from": self.inputs.init_from,
                    "recipe": self.recipe_in_use(),
                    "data_inputs": _data_inputs(
                        self.inputs.split, self.inputs.vocab, self.inputs.data_config
                    ),
                    "segments": self.segments(),
                    ckpt.DATA_CONFIG_RECORD: ckpt.data_config_record(
                        self.inputs.data_config
                    ),  # --export-only sans shards
                },
                keep=self.t.keep_checkpoints,
            )
        _barrier(d)
        return path

    # ---- one micro-batch ---------------------------------------------------------------------
    def device_batch(self, batch: dict) -> dict:
        """A loader batch on the device, with its hidden states (from the shards, or computed online)."""
        return self.inputs.states.fill(_move_batch(batch, self.d.device, self.inputs.feat_dtype))

    def targets(self, batch: dict):
        """Verifier targets: only at the loss rows (``loss_pos``, eagle3/train/ttt_rows.py: [M,dV], [M], [M]) when the
        batch lists them, else at every position ([B,L,dV], [B,L], [B,L]; bench/small_train_speed.py legacy loop)."""
        from eagle3.train.ttt import compute_targets
        from eagle3.train.ttt_rows import row_targets

        i = self.inputs
        with torch.no_grad():
            if "loss_pos" in batch:
                return row_targets(
                    batch["last"],
                    batch["loss_pos"],
                    i.head_lm,
                    i.d2t,
                    i.t2d,
                    norm_weight=i.head_norm,
                    norm_eps=i.head_eps,
                    chunk=TARGET_CHUNK,
                )
            return compute_targets(
                batch["last"],
                i.head_lm,
                i.d2t,
                i.t2d,
                norm_weight=i.head_norm,
                norm_eps=i.head_eps,
                chunk=TARGET_CHUNK,
            )

    # ---- validation ----------------------------------------------------------------------------
    def validate(self) -> dict:
        """Loss and accuracy on the val split: each sample once (rank r takes r, r+W, ...), token-weighted."""
        data, t, d, drafter = self.data, self.t, self.d, self.inputs.drafter
        if data.val_ds is None:
            return {}
        # each sample exactly once (no DistributedSampler padding, which would count some twice);
        # ranks may get different numbers of batches: nothing below is a collective until the reduce
        if (
            data.val_lengths is not None
        ):  # token budget: this rank's samples (r, r+W, ...) in length-sorted batches
            vl = DataLoader(
                data.val_ds,
                batch_sampler=eval_batches(data.val_lengths, t.batch_tokens, d.world, d.rank),
                **_loader_kwargs(t, d.device, d.world),
            )
        else:
            vl = DataLoader(
                data.val_ds,
                batch_size=t.batch_size,
                sampler=list(range(d.rank, len(data.val_ds), d.world)),
                collate_fn=collate,
            )
        acc = _Accum(t.ttt_length)
        drafter.eval()
        with torch.no_grad():
            for batch in self.inputs.states.wrap(iter(vl)):
                batch = self.device_batch(batch)
                tl, ind, tam = self.targets(
                    batch
                )  # [M,dV], [M], [M] (loss rows) or [B,L,dV], [B,L], [B,L]
                amp = self.inputs.amp
                ctx = (
                    torch.autocast(device_type=d.device.type, dtype=amp)
                    if amp is not None
                    else contextlib.nullcontext()
                )
                with ctx:  # no DDP wrapper: no gradient sync in eval
                    if "loss_pos" in batch:
                        _loss, stats = self.opt.objective(
                            batch["input_ids"],
                            batch["aux"],
                            tl,
                            ind,
                            tam,
                            loss_pos=batch["loss_pos"],
                        )
                    else:
                        _loss, stats = self.opt.objective(
                            batch["input_ids"], batch["aux"], tl, ind, tam, batch["loss_mask"]
                        )
                acc.add(stats)
        drafter.train()
        return _Accum.summarize(_reduce_totals(acc.totals(), d), t.step_weight)

    # ---- the loop ------------------------------------------------------------------------------
    def loop(self, stop: StopFlag, stop_after: Optional[int]) -> None:
        """Optimizer steps until ``total_steps``, a stop signal or ``stop_after`` steps of this call."""
        from tqdm.auto import tqdm

        from eagle3.train.sim_accept import BestTracker, effective_chain

        t = self.t
        self.metrics = _Metrics(
            self.train_dir, self.step, self.d.is_main, finished=self.step >= self.total_steps
        )
        chain, capped = effective_chain(t.select_chain, self.cfg.benchmark.steps, t.ttt_length)
        if (
            capped and self.d.is_main
        ):  # once per call, also in train_report's warnings (_collect_warnings)
            log.warning(capped)
        # an end set in steps (--stop-at, a step cap): a best kept from before the resume past it is dropped
        end = self.end_step if (self.stop_at is not None or self.data.horizon is not None) else None
        self.tracker = BestTracker(
            self.train_dir,
            chain,
            self.d.is_main,
            start_step=self.step,
            keep_best=t.select_best == "sim_accept",
            end_step=end,
        )
        self.inputs.drafter.train()
        self.window = _Accum(self.t.ttt_length)
        self.tok_window = (
            0  # real (non-pad) tokens of this rank since the last log, from CPU lengths
        )
        self.t_window = time.perf_counter()
        self.paused = 0.0  # seconds of validation / checkpoint writes inside the current log window (not counted)
        self.bar = tqdm(
            total=self.total_steps,
            initial=self.step,
            disable=not self.d.is_main,
            desc="train",
            unit="step",
            dynamic_ncols=True,
        )
        it = None
        try:
            while self.step < self.end_step and not self.stopped:
                order = self.data.order
                if self.step_in_epoch >= order.steps_in_epoch(self.epoch):
                    self.epoch, self.step_in_epoch = self.epoch + 1, 0
                it = self.inputs.states.wrap(order.iterate(self.epoch, self.step_in_epoch))
                for _ in range(self.step_in_epoch, order.steps_in_epoch(self.epoch)):
                    if self.step >= self.end_step:
                        break
                    if (
                        self.steps_this_call == 0
                    ):  # a signal while the loop started (loaders, first batch)
                        stop_before_training(stop, self.d)
                    grad_norm, lr_used = self.train_step(it)
                    if self.step % self.t.log_every == 0 or self.step == self.end_step:
                        self.log_step(grad_norm, lr_used)
                    if self.after_step(stop, stop_after):
                        break
                it = _close_iter(it)
        finally:
            _close_iter(
                it
            )  # stops this epoch's loader workers / capture threads now (prefetched batches dropped)
            self.bar.close()

    def train_step(self, it) -> tuple[torch.Tensor, float]:
        """One optimizer step: ``grad_accum`` micro-batches from ``it``, forward + backward
        (:func:`backward_step`), clipping, AdamW, schedule. Returns ``(grad norm (device), LR used)``."""
        t, o = self.t, self.opt
        batches = []
        for _micro in range(t.grad_accum):
            batch = next(it)
            self.tok_window += int(batch["lengths"].sum())
            batches.append(self.device_batch(batch))
        for stats in backward_step(
            o.model,
            batches,
            [self.targets(b) for b in batches],
            t.ttt_length,
            self.d,
            self.inputs.amp,
        ):
            self.window.add(stats)
        del batches
        grad_norm = torch.nn.utils.clip_grad_norm_(o.params, t.grad_clip)
        o.optimizer.step()
        o.optimizer.zero_grad(set_to_none=True)
        lr_used = o.scheduler.get_last_lr()[0]
        o.scheduler.step()
        self.step += 1
        self.steps_this_call += 1
        self.step_in_epoch += 1
        self.bar.update(1)
        return grad_norm, lr_used

    def log_step(self, grad_norm: torch.Tensor, lr_used: float) -> None:
        """Log step: the window's loss/accuracy over all ranks, LR, grad norm, tokens/s (host sync here only);
        online, the NaN/Inf flag of the window's verifier states (:meth:`_check_states`)."""
        d = self.d
        self._check_states()
        means = _Accum.summarize(_reduce_totals(self.window.totals(), d), self.t.step_weight)
        elapsed = (
            time.perf_counter() - self.t_window - self.paused
        )  # includes the sync of this log step
        toks = _sum_ranks([float(self.tok_window)], d)[0]
        self.tok_total, self.t_total = self.tok_total + toks, self.t_total + elapsed
        row = {
            "kind": "train",
            "step": self.step,
            "epoch": self.epoch,
            "lr": lr_used,
            "grad_norm": float(grad_norm),
            "tokens_per_s": toks / max(elapsed, 1e-9),
            "window_tokens": toks,
            "window_s": elapsed,
            **means,
        }
        self.metrics.write(row)
        self.bar.set_postfix(loss=f"{means.get('loss', float('nan')):.4f}", lr=f"{lr_used:.2e}")
        self.window = _Accum(self.t.ttt_length)
        self.tok_window, self.t_window, self.paused = 0, time.perf_counter(), 0.0

    def _check_states(self) -> None:
        """Stop every rank with a UserError when some rank's online verifier states were NaN/Inf since the last
        check (:meth:`eagle3.train.online.VerifierStates.states_finite`; offline shards were checked by 02)."""
        if _any_rank(not self.inputs.states.states_finite(), self.d):
            raise self.inputs.states.nonfinite_error(self.step)

    def after_step(self, stop: StopFlag, stop_after: Optional[int]) -> bool:
        """Hooks between optimizer steps (their time is not counted in tokens/s): periodic validation,
        the stop decision (all ranks agree), checkpoints. Returns True when the run stops here."""
        t, d = self.t, self.d
        t_pause = time.perf_counter()
        if self.eval_due() and self.step != self.end_step:  # the end step: finish() validates
            val = self.validate()
            if val:  # the best weights on disk before the row is logged: a logged validation is never lost
                self.tracker.update(self.step, self.epoch, val, self.inputs.drafter)
                self.metrics.write({"kind": "val", "step": self.step, "epoch": self.epoch, **val})
        want_stop = stop.requested or (
            stop_after is not None and self.steps_this_call >= stop_after
        )
        self.stopped = _any_rank(want_stop, d)
        if self.step % t.ckpt_every == 0 or self.stopped or self.step == self.end_step:
            self.last_ckpt = self.save()
        self.paused += time.perf_counter() - t_pause
        if self.stopped and d.is_main:
            why = f"signal {stop.signum}" if stop.signum else f"stop_after={stop_after}"
            log.info("stopped at step %d (%s); checkpoint %s", self.step, why, self.last_ckpt)
        return self.stopped

    def eval_due(self) -> bool:
        """Validate after this optimizer step? Every ``train.eval_every`` steps when it is set; else at the end of each
        epoch: its last step, counted by the epoch's own step count. That count varies with ``train.batch_tokens``
        (each epoch's batches are re-planned: 640, 639, 639, 640 steps for 6,000 samples of 5-400 tokens at 2,048),
        and with a resume on another process count; the default used to be the first epoch's step count, so
        validations drifted off the epoch ends (steps 640, 1,280, 1,920 against epoch ends 640, 1,279, 1,918)."""
        if self.data.eval_every is not None:
            return self.step % self.data.eval_every == 0
        return self.step_in_epoch >= self.data.order.steps_in_epoch(self.epoch)

    # ---- end -----------------------------------------------------------------------------------
    def finish(self, stop: StopFlag, export: Optional[Callable] = None) -> dict:
        """End step: the result dict; unless stopped: final validation, ``export`` (rank 0; see :func:`run`), the report."""
        d = self.d
        result = {
            "step": self.step,
            "total_steps": self.total_steps,
            "stop_at": self.stop_at,
            "stopped": self.stopped,
            "signal": stop.signum if self.stopped else None,
            "checkpoint": str(self.last_ckpt) if self.last_ckpt else None,
            "export_dir": None,
            "final_val": {},
            "tokens_per_s": (self.tok_total / self.t_total) if self.t_total > 0 else None,
            "peak_gpu_mem_gib": _peak_gpu_mem_gib(d.device),
            "hidden_states": self.t.hidden_states,
            "init_from": self.inputs.init_from,
            "segments": self.segments(),
            "recipe": self.recipe_used(),
            "warnings": self.warnings,
            "val_samples": len(self.data.val_ds) if self.data.val_ds is not None else 0,
        }
        if not result[
            "val_samples"
        ]:  # said in the report and the closing lines, not an empty tau table
            result["no_validation"] = no_validation_note(result["step"], stopped=self.stopped)
        if (
            self.stopped
        ):  # no final validation, no export; the report says where it stopped and how to go on
            self.metrics.close()
            if d.is_main:
                result["sim_accept"] = dict(
                    self.tracker.summary(),
                    select_best=self.t.select_best,
                    exported_step=None,
                    stopped=True,
                )
                write_report(self.train_dir, result, self.inputs.args)
            _barrier(d)
            return result
        final_val = self.validate()
        self._check_states()
        if final_val:
            self.tracker.update(self.step, self.epoch, final_val, self.inputs.drafter)
            self.metrics.write({"kind": "val", "step": self.step, "epoch": self.epoch, **final_val})
        result["final_val"] = final_val
        self.metrics.close()
        if d.is_main:
            try:
                self._select_and_export(result, export)
            except Exception as e:  # the training is done: its report is written anyway, saying why nothing was exported
                raise self._export_failed(result, e) from e
            write_report(self.train_dir, result, self.inputs.args)
            print(headline(result, self.train_dir, self.inputs.args))
        _barrier(d)
        return result

    def _select_and_export(self, result: dict, export: Optional[Callable]) -> None:
        """Rank 0 after the final validation: the selected weights (``train.select_best``) into the drafter, the
        simulated-acceptance curve's plot, and ``export`` (see :func:`run`) into ``result["export_dir"]``."""
        sel = self.t.select_best
        result["sim_accept"] = dict(
            self.tracker.summary(),
            select_best=sel,
            exported_step=self.tracker.restore_best(self.inputs.drafter)
            if sel == "sim_accept"
            else None,
        )
        if (
            sel == "sim_accept" and result["sim_accept"]["exported_step"] is None
        ):  # nothing was selected
            log.warning(
                _no_val_selection(self.cfg)
                if self.data.val_ds is None
                else f"train.select_best: sim_accept found no best weights to restore; the last step's weights "
                f"(step {self.step}) are exported instead"
            )
        self.tracker.plot()
        if export is not None:
            prov = export_provenance(
                self.train_dir,
                self.last_ckpt,
                self.step,
                sel,
                result["sim_accept"]["exported_step"] or self.step,
            )
            result["export_dir"] = str(
                export(self.cfg, self.inputs.drafter, self.inputs.data_config, provenance=prov)
            )

    def _export_failed(self, result: dict, e: Exception) -> Exception:
        """After a finished training whose selection or export failed (e.g. the SGLang export refusing a
        ``drafter.max_position_embeddings`` below the verifier's): ``train_report.{json,md}`` written anyway
        (``export_error``: the reason and the fix), and the error to raise: a :class:`UserError` says in its one line
        that the checkpoint and the report are kept and how to export (``--export-only``); another error is returned
        as it is (a bug keeps its traceback)."""
        why = str(e) if isinstance(e, UserError) else f"{type(e).__name__}: {e}"
        result["export_error"] = why
        result.setdefault(
            "sim_accept",
            dict(self.tracker.summary(), select_best=self.t.select_best, exported_step=None),
        )
        try:
            write_report(self.train_dir, result, self.inputs.args)
        except Exception as w:  # noqa: BLE001 - the export's error is the one to tell
            log.warning("train_report: could not be written after the failed export (%s)", w)
            return e
        if not isinstance(e, UserError):
            return e
        err = UserError(
            f"{why} [training finished: checkpoint {self.last_ckpt} kept, report "
            f"{self.train_dir / 'train_report.md'}; after the fix, 04_train.py --export-only exports it "
            f"without retraining]"
        )
        err.exit_code = e.exit_code
        return err


def segment_record(
    start: int,
    end: int,
    hidden_states: Optional[str],
    backend: Optional[str],
    world_size: int,
    tokens_per_s: Optional[float],
    peak_gpu_mem_gib: Optional[float] = None,
    warnings: Sequence[str] = (),
) -> dict:
    """One part of a run (the optimizer steps one 04 call trained): ``{start_step, end_step, hidden_states,
    extract_backend (online: where the states came from, hf or sglang; offline: None), world_size, tokens_per_s,
    peak_gpu_mem_gib, warnings (the call's warning lines)}``. A resumed run used to report only its last call's
    ``hidden_states``, throughput and warnings."""
    return {
        "start_step": int(start),
        "end_step": int(end),
        "hidden_states": hidden_states,
        "extract_backend": backend if hidden_states == "online" else None,
        "world_size": int(world_size),
        "tokens_per_s": tokens_per_s,
        "peak_gpu_mem_gib": peak_gpu_mem_gib,
        "warnings": list(warnings),
    }


def earlier_segments(state: dict) -> list[dict]:
    """The ``segments`` a checkpoint records (:func:`segment_record`), each ending at the checkpoint's step at the
    latest; a checkpoint from before the key gives one part, steps 0 to its step, whose ``hidden_states`` is None
    (not recorded)."""
    step = int(state["step"])
    segs = state.get("segments")
    if not isinstance(segs, list):
        return (
            [segment_record(0, step, None, None, int(state.get("world_size", 1)), None)]
            if step > 0
            else []
        )
    out = []
    for g in segs:
        if isinstance(g, dict) and int(g.get("start_step", step)) < step:
            out.append({**g, "end_step": min(int(g["end_step"]), step)})
    return out


def state_source_switch(path: Path, earlier: list[dict], now: dict) -> Optional[str]:
    """The warning of a resume that takes its hidden states from another source than the checkpoint's last part
    (``train.hidden_states`` offline <-> online, or online's ``extract.backend``), None when it is the same or
    unrecorded. Both sources give the verifier's states, the same up to the shards' storage rounding (bf16 / fp8) and
    the capture's dtype, so the resume is allowed; the report lists each part (``segments``)."""
    if not earlier or earlier[-1].get("hidden_states") is None:
        return None
    last = earlier[-1]

    def name(g: dict) -> str:
        return g["hidden_states"] + (
            f" (extract.backend {g['extract_backend']})" if g.get("extract_backend") else ""
        )

    if name(last) == name(now):
        return None
    return (
        f"{path}: steps {last['start_step']}-{last['end_step']} were trained with train.hidden_states "
        f"{name(last)}, this call trains with {name(now)} from step {now['start_step']}; the states are the same "
        f"verifier's up to the shards' storage rounding (bf16 / fp8) and the capture dtype; train_report.json "
        f"'segments' lists each part"
    )


def export_provenance(
    train_dir: Path, checkpoint, step: int, select_best: str, selected_step: int
) -> dict:
    """Where an export's weights come from, recorded as ``trained_from`` in its ``eagle3_train.json`` (04 at the
    end of training and ``--export-only``).

    Args:
        train_dir: the run's ``train.output_dir`` (recorded absolute).
        checkpoint: the checkpoint file of the run's ``step`` (absolute; None when there is none).
        step: the optimizer step the run (or the checkpoint) is at.
        select_best: ``train.select_best``.
        selected_step: the step whose weights are exported (the best validation's under ``sim_accept``, else ``step``).

    Returns:
        ``{train_dir, checkpoint, step, select_best, selected_step}``.
    """
    return {
        "train_dir": str(Path(train_dir).resolve()),
        "checkpoint": str(Path(checkpoint).resolve()) if checkpoint else None,
        "step": int(step),
        "select_best": select_best,
        "selected_step": int(selected_step),
    }


def _close_iter(it) -> None:
    """Stop a batch iterator now: loader workers end when the last reference goes; an online capture
    iterator (:mod:`eagle3.train.online`) stops its threads (:meth:`close`). Returns None (to clear the name)."""
    close = getattr(it, "close", None)
    if callable(close):
        close()
    return None


def _peak_gpu_mem_gib(device: torch.device) -> Optional[float]:
    """Peak memory this process allocated on ``device`` through PyTorch's caching allocator (GiB), None off CUDA.

    Counts tensors only (``torch.cuda.max_memory_allocated``), not the allocator's reserve or the CUDA context;
    it is what decides how many trainings share one GPU (bench/gpu_session.sh SLOTS)."""
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 2**30


def no_validation_note(step: int, stopped: bool = False) -> str:
    """What a run without a validation split (``data.val_fraction: 0`` at stage 03) measures and exports: the
    sentence of ``train_report.json``'s ``no_validation``, ``train_report.md`` and 04's closing lines (``stopped``:
    a run stopped by a signal, exported later: by ``--resume`` at its end or by ``--export-only``)."""
    what = (
        "an export (at the end of `--resume`, or `--export-only`) holds the last step's weights"
        if stopped
        else f"the export holds the last step's weights (step {step})"
    )
    return (
        f"no validation split (data.val_fraction is 0: stage 03's split.json has no 'val' samples), so no "
        f"validation loss, accuracy or simulated acceptance (tau); {what}; set data.val_fraction > 0 and re-run "
        f"03 and 04 to measure them"
    )


def headline(result: dict, train_dir: Path, args=None) -> str:
    """The lines stage 04 prints at its end: optimizer steps, final validation loss and top-1 accuracy per
    TTT step (``final_val``'s ``loss`` / ``acc_{i}``, as in ``train_report.md``), the drafter's shape (``args``:
    :class:`eagle3.drafter.model.DrafterArgs`, when given), the report and the export."""
    val = result.get("final_val") or {}
    acc = [
        val[k]
        for k in sorted(
            (k for k in val if k.startswith("acc_")), key=lambda k: int(k.split("_")[-1])
        )
    ]
    text = f"trained: {result['step']}/{result['total_steps']} optimizer steps"
    if result.get("stop_at") and not result.get("stopped"):
        text += f" (--stop-at {result['stop_at']}: the lr followed the {result['total_steps']}-step schedule)"
    if "loss" in val:
        text += f"; final validation loss {val['loss']:.4f}"
    if acc:
        text += f", top-1 {' / '.join(f'{a:.3f}' for a in acc)} (TTT steps 0..{len(acc) - 1})"
    elif not val:
        text += "; " + (result.get("no_validation") or no_validation_note(result["step"]))
    picked = selected_weights_line(result)
    shape = [] if args is None else [f"drafter: {drafter_shape(args)}"]
    return "\n".join(
        [
            text,
            *([picked] if picked else []),
            *shape,
            f"report: {train_dir / 'train_report.md'}",
            f"export: {result['export_dir']}",
        ]
    )


def selected_weights_line(result: dict) -> Optional[str]:
    """``exported: the weights of step 5, ...`` when ``train.select_best: sim_accept`` exported another step's weights
    than the last one, whose figures the ``final validation`` line gives (04's closing lines, ``train_report.md``);
    None otherwise. The headline said only the last step's loss and top-1 above ``export: <folder>``, though the
    folder held an earlier step's weights (fresh-user trial 2026-12-05f)."""
    sa = result.get("sim_accept") or {}
    step, best = sa.get("exported_step"), sa.get("best") or {}
    if step is None or int(step) == int(result["step"]):
        return None
    k = sa.get("chain")
    last = next((r for r in sa.get("rows") or [] if r.get("step") == result["step"]), None)
    text = f"exported: the weights of step {step}, not the last step's (train.select_best: {sa.get('select_best')}"
    if best.get("step") == step:
        text += f": the best validation, tau_sim({k}) {best['tau_sim']:.4f}"
        if last is not None:
            text += f" against {last['tau_sim']:.4f} at step {result['step']}"
        if isinstance(best.get("loss"), (int, float)):
            text += f"; its validation loss {best['loss']:.4f}"
        if best.get("alpha"):
            text += f", top-1 {' / '.join(f'{a:.3f}' for a in best['alpha'])}"
    return text + ")"


def drafter_shape(args, hidden: bool = False) -> str:
    """``eagle3.1, 2 decoder layers, [hidden 576, ]MLP 6144, draft vocab 32000`` of a
    :class:`eagle3.drafter.model.DrafterArgs` (04's closing lines and ``train_report.md``)."""
    return (
        f"{args.variant}, {args.num_layers} decoder layer{'s' if args.num_layers > 1 else ''}, "
        + (f"hidden {args.hidden_size}, " if hidden else "")
        + f"MLP {args.intermediate_size}, draft vocab {args.draft_vocab_size}"
    )


def _export_line(result: dict) -> str:
    """The ``- export:`` value of ``train_report.md``: the export folder, or a sentence why there is none."""
    if result.get("export_dir"):
        return f"`{result['export_dir']}`"
    if result.get("export_error"):
        return (
            f"**refused**: {result['export_error']}. Training finished and its checkpoint is kept: after the fix, "
            f"`04_train.py --export-only` exports it without retraining"
        )
    if result.get("stopped"):
        what = _export_only_what(result, "the newest checkpoint")
        return f"none (stopped before the end; `04_train.py --resume` goes on, `--export-only` exports {what})"
    return "none (no export was asked for)"


def _export_only_what(result: dict, checkpoint: str) -> str:
    """What ``04 --export-only`` exports of a stopped run: with ``train.select_best: sim_accept`` and a best validation,
    its weights (``best_drafter.pt``), as the tau_sim table's heading says; else ``checkpoint`` (its wording)."""
    from eagle3.train.sim_accept import BEST_FILE

    sim = result.get("sim_accept") or {}
    best = sim.get("best") or {}
    if sim.get("select_best") == "sim_accept" and best.get("step") is not None:
        return f"step {best['step']}, the best validation's weights ({BEST_FILE})"
    return checkpoint


def record_export_only(
    train_dir: Path,
    export_dir: Path,
    checkpoint: Path,
    ckpt_step: int,
    weights_step: int,
    engine: str,
    select_best: Optional[str] = None,
) -> bool:
    """After ``04 --export-only``: ``train_report.{json,md}`` say what was exported (``export_dir``; ``export_only``:
    the checkpoint, the step whose weights it holds (the checkpoint's ``ckpt_step`` or, under ``train.select_best:
    sim_accept``, the best validation's), the engine; ``sim_accept.exported_step``), so a report written when the run
    stopped (``export: none``) or when its export was refused (``export_error``) no longer contradicts the folder.
    Nothing happens without a ``train_report.json`` written at ``ckpt_step`` (a report of an older step, an
    unreadable one, a train folder that takes no file (read-only storage): a warning, the export stands). An
    export of this train folder already recorded in another folder
    (the finished run's ``drafter-sglang`` before ``--export-only --engine vllm``) stays listed in ``other_exports``
    while that folder holds it; ``select_best`` (this export's, when given) replaces the training run's in
    ``sim_accept``, whose ``exported_step`` is now this export's.

    Returns:
        Whether the report was rewritten.
    """
    from eagle3.drafter.model import DrafterArgs

    path = train_dir / "train_report.json"
    if not path.is_file():
        return False
    try:
        report = read_json(path)
        args = DrafterArgs.from_json(report.pop("drafter_args"), source=f"{path}: drafter_args")
    except (UserError, KeyError, TypeError, ValueError) as e:
        log.warning("%s: not updated after --export-only (%s)", path, e)
        return False
    if report.get("step") != int(ckpt_step):
        log.warning(
            "%s: written at step %s, not at the exported checkpoint's step %d (%s): not updated",
            path,
            report.get("step"),
            ckpt_step,
            checkpoint,
        )
        return False
    report.pop("export_error", None)
    earlier = [
        o.get("export_dir") for o in report.get("other_exports") or [] if isinstance(o, dict)
    ]
    others = [
        _export_record(Path(d), train_dir)
        for d in dict.fromkeys(earlier + [report.get("export_dir")])
        if d and Path(d).resolve() != Path(export_dir).resolve()
    ]
    report["other_exports"] = [o for o in others if o is not None]
    report["export_dir"] = str(export_dir)
    report["export_only"] = {
        "checkpoint": str(checkpoint),
        "weights_step": int(weights_step),
        "engine": engine,
    }
    try:  # a train folder on read-only storage (a colleague's checkpoints): the export stands, as for an old report
        probe_dirs(train_dir)
    except UserError as e:
        log.warning(
            "%s: not updated after --export-only (%s); the export in %s stands", path, e, export_dir
        )
        return False
    if isinstance(report.get("sim_accept"), dict):
        report["sim_accept"]["exported_step"] = int(weights_step)
        if select_best:
            report["sim_accept"]["select_best"] = select_best
    write_report(train_dir, report, args)
    return True


def _export_record(folder: Path, train_dir: Path) -> Optional[dict]:
    """``{export_dir, engine, weights_step, select_best}`` of an export of ``train_dir`` still in ``folder`` (from its
    ``eagle3_train.json``), or None: no such folder, an unreadable record, or an export of another train folder."""
    try:
        info = read_json(folder / EXPORT_META_FILE)
        src = info.get("trained_from") or {}
        if Path(src["train_dir"]).resolve() != Path(train_dir).resolve():
            return None
        return {
            "export_dir": str(folder),
            "engine": info["engine"],
            "weights_step": src.get("selected_step"),
            "select_best": src.get("select_best"),
        }
    except (UserError, OSError, KeyError, TypeError, AttributeError):
        return None


def write_report(train_dir: Path, result: dict, args) -> None:
    """``train_report.json`` + ``train_report.md`` (final validation per TTT step) + ``loss.png`` (train/val loss),
    as one set (:func:`eagle3.io.atomic_write_files`: a full disk replaces none of them; written one by one, it left
    the new JSON beside the earlier Markdown). A run stopped by a signal gets one too (``stopped``, ``signal``, its
    step, no ``final_val``); the run that resumes it rewrites it."""
    from eagle3.io import atomic_write_files

    report = dict(result, drafter_args=args.to_json())
    files = [
        (
            train_dir / "train_report.json",
            (json.dumps(report, indent=2, ensure_ascii=False) + "\n").encode(),
        ),
        (train_dir / "train_report.md", _report_markdown(result, args).encode("utf-8")),
    ]
    png = _loss_png(_read_metrics(train_dir / "metrics.jsonl"))
    if png is not None:
        files.append((train_dir / "loss.png", png))
    atomic_write_files(files)


def _report_markdown(result: dict, args) -> str:
    """``train_report.md`` of :func:`write_report`."""
    val = result.get("final_val") or {}
    acc_keys = sorted((k for k in val if k.startswith("acc_")), key=lambda k: int(k.split("_")[-1]))
    lines = [
        "# Training report",
        "",
        f"- optimizer steps: {result['step']} / {result['total_steps']}"
        + (
            f" (ended at `--stop-at {result['stop_at']}` on the {result['total_steps']}-step lr schedule)"
            if result.get("stop_at") and not result.get("stopped")
            else ""
        ),
        f"- drafter: {drafter_shape(args, hidden=True)}",
        f"- checkpoint: `{result['checkpoint']}`",
        f"- export: {_export_line(result)}",
    ]
    picked = selected_weights_line(result) if result.get("export_dir") else None
    if picked:
        lines.append(f"- {picked}")
    if result.get("stopped"):
        lines.append(
            f"- **stopped** by signal {result.get('signal')} at step {result['step']}: no final validation"
            + (
                ", exported afterwards by `--export-only` (below)"
                if result.get("export_only")
                else ", no export; `04_train.py --resume` goes on, `--export-only` exports "
                + _export_only_what(result, "this checkpoint")
            )
        )
    if result.get("export_only"):
        e = result["export_only"]
        lines.append(
            f"- exported by `04_train.py --export-only` ({e['engine']}): the weights of step "
            f"{e['weights_step']} (checkpoint `{e['checkpoint']}`)"
        )
    lines += [
        f"- also exported: `{o['export_dir']}` ({o['engine']}, the weights of step {o['weights_step']}, "
        f"select_best: {o['select_best']})"
        for o in result.get("other_exports") or []
    ]
    lines += [f"- **warning**: {w}" for w in result.get("warnings") or []]
    segs = result.get("segments") or []
    if (
        len(segs) > 1
    ):  # a resumed run: each part's state source, processes and throughput, earlier calls' warnings
        lines.append("- trained in parts: " + "; ".join(_segment_text(g) for g in segs))
        lines += [
            f"- **warning** (steps {g['start_step']}-{g['end_step']}): {w}"
            for g in segs[:-1]
            for w in g.get("warnings") or []
        ]
    if result.get("tokens_per_s"):
        lines.append(
            f"- training throughput: {result['tokens_per_s']:.0f} tokens/s (all ranks"
            + (
                f"; this call's, steps {segs[-1]['start_step']}-{segs[-1]['end_step']})"
                if len(segs) > 1
                else ")"
            )
        )
    if result.get("peak_gpu_mem_gib") is not None:
        lines.append(f"- peak GPU memory (tensors, rank 0): {result['peak_gpu_mem_gib']:.1f} GiB")
    if "loss" in val:
        lines.append(f"- final validation loss: {val['loss']:.4f}")
    if acc_keys:
        lines += ["", "| TTT step | val top-1 acc |", "|---:|---:|"]
        lines += [f"| {k.split('_')[-1]} | {val[k]:.4f} |" for k in acc_keys]
    if result.get("no_validation"):  # instead of an empty simulated-acceptance table
        lines += ["", f"Validation: {result['no_validation']}."]
    elif result.get("sim_accept"):
        from eagle3.train.sim_accept import markdown_lines

        lines += ["", *markdown_lines(result["sim_accept"])]
    return "\n".join(lines) + "\n"


def _segment_text(g: dict) -> str:
    """One part of ``segments`` for ``train_report.md``: ``steps 0-40 offline, 1 process, 1234 tokens/s``."""
    how = g.get("hidden_states") or "hidden states not recorded"
    if g.get("extract_backend"):
        how += f" ({g['extract_backend']})"
    n = g.get("world_size")
    tps = f", {g['tokens_per_s']:.0f} tokens/s" if g.get("tokens_per_s") else ""
    return (
        f"steps {g['start_step']}-{g['end_step']} {how}, {n} process{'' if n == 1 else 'es'}{tps}"
    )


def _loss_png(rows: list[dict]) -> Optional[bytes]:
    """``loss.png`` of :func:`write_report`: train and val loss per optimizer step from ``metrics.jsonl``'s ``rows``
    (None without a train loss)."""
    import io

    tr = [(r["step"], r["loss"]) for r in rows if r.get("kind") == "train" and "loss" in r]
    va = [(r["step"], r["loss"]) for r in rows if r.get("kind") == "val" and "loss" in r]
    if not tr:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(
        *zip(*tr), "-" if len(tr) > 1 else "o", label="train"
    )  # one row (a run shorter than log_every): a dot
    if va:
        ax.plot(*zip(*va), "o-", label="val")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("TTT loss")
    ax.legend()
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()
