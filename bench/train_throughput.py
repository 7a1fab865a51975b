"""Benchmark: the real stage-04 training step (drafter TTT + verifier targets + backward + AdamW) at a given shape.

What one timed step is (the same calls as ``eagle3.stages.train._run`` with ``grad_accum = 1``):

1. ``eagle3.losses.ttt.compute_targets(last, lm_head [V, Ht], d2t, t2d, chunk=eagle3.train.loop.TARGET_CHUNK)``
   under ``no_grad``: the verifier's soft targets from its last hidden state (full ``V``-column LM head);
2. ``eagle3.train.loop.backward_step``: the step's token counts and loss denominators
   (``eagle3.losses.ttt.step_denominators``, one all-reduce per step under DDP), then
   ``eagle3.train.loop.TTTObjective`` (``drafter.ttt_forward`` over all ``ttt`` steps + ``ttt_loss``) under
   ``torch.autocast(dtype=eagle3.train.inputs.autocast_dtype(...))`` (bf16 on GPU, none on CPU; the
   drafter's weights stay float32 masters), optionally wrapped in ``torch.compile``, and ``loss.backward()``;
3. ``clip_grad_norm_(params, grad_clip)``, ``AdamW.step()``,
   ``zero_grad(set_to_none=True)``, ``LambdaLR.step()`` (``eagle3.train.schedule.build_scheduler``),
   with ``lr``, ``weight_decay``, ``grad_clip``, ``step_weight`` and ``warmup_ratio`` at their
   ``eagle3.settings.train.TrainConfig`` defaults.

Inputs are synthetic random tensors of the training shapes: ``input_ids`` int64 ``[1, L]``,
``aux`` ``[1, L, 3Ht]`` and ``last`` ``[1, L, Ht]`` in the feature dtype train.py uses (bf16 under
autocast, else float32), ``loss_mask`` ones ``[1, L]``, and a random vocab map (``draft_V`` of
``V`` verifier ids, sorted, as ``vocab_map.pt``'s ``d2t`` int64 ``[draft_V]`` / ``t2d`` bool ``[V]``).

Model FLOPs of one step (batch 1, sequence ``L``, ``K`` TTT steps; the reference's counting)::

    P_step = 2H*(nh + 2*kvh)*hd      # q, k, v projections of the 2H-wide input
           + nh*hd*H                 # o_proj
           + 3*H*I                   # gate, up, down
           + H*draft_V               # lm_head to the draft vocab
    P_fc   = 3*Ht*H                  # fc, once per token (not per TTT step)
    dense  = 6 * L * (K*P_step + P_fc)                   # 2 forward + 4 backward per weight per token
    causal = 3 * K * (4 * L*L/2 * nh * hd)               # every step's queries vs the step-0 causal keys,
                                                         # QK^T and PV (2 x 2 FLOPs), half the square; x3 fwd+bwd
    diag   = 3 * sum_{i<K} 4 * L * i * nh * hd           # step i's i diagonal keys (steps 1..i at t), x3
    target = 2 * Ht * V * L                              # verifier LM head forward (no grad)
    total  = dense + causal + diag + target

At the reference shape (H = Ht = 7168, nh = kvh = 64, hd = 128, I = 18432, draft_V = 32000,
V = 163840, L = 4096, K = 7) this is 1.9755e14 FLOPs per step (the issue's "about 1.98e14");
with 8 KV heads 1.6219e14. It is a *model* FLOP count: work the step does but that the count
leaves out (the logits recomputed in backward with ``checkpoint_logits``, the sdpa TTT kernel's
``round_up(2i, 8)`` extra head-dim channels and ``i`` dummy queries, RMSNorm/rotary/softmax
elementwise work) is not credited, and ``fc`` is counted at 6x although its input needs no
gradient (4x would be its real matmul work; the difference is 0.3% of the total).

MFU = total / step time / ceiling, where the ceiling is MEASURED in the same process: the mean
rate of a square ``n^3`` matmul (``n`` = 8192 in bf16 on GPU; on CPU ``n`` = 512 in float32, the
dtype CPU training computes in) over 10 runs after 3 warm-ups.

``--max-seq-search`` runs each ``--search-seqs`` length (default 8192) for one warm-up + one timed
step and reports whether it fits: no out-of-memory and peak memory <= ``--mem-budget-gib``.

Prints a Markdown table and the JSON result (also written to ``--json``). On the H200 (torch 2.11,
whose image lacks pydantic: install the project's wheels from ``.whl`` first)::

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/pydantic*.whl \
        .whl/annotated_types*.whl .whl/typing_inspection*.whl .whl/typing_extensions*.whl
    export PYTHONPATH=/tmp/site
    python bench/train_throughput.py --kv-heads 64 8 --json $OUT/train_throughput.json
    python bench/train_throughput.py --kv-heads 64 8 --compile --json $OUT/train_throughput_compile.json
    python bench/train_throughput.py --kv-heads 64 8 --max-seq-search --mem-budget-gib 96 --json $OUT/max_seq.json

CPU smoke run (a few seconds)::

    python bench/train_throughput.py --tiny --device cpu --json /tmp/tt.json

DDP mode (multi-GPU scaling). Launched under ``torchrun`` (env ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``),
every rank runs the same step as above with the ``TTTObjective`` wrapped exactly as
``eagle3.stages.train._run`` wraps it: ``eagle3.train.ranks.init_distributed`` (NCCL on ``cuda:LOCAL_RANK``, gloo
with ``--device cpu``, plus a gloo control group), ``DistributedDataParallel(objective,
device_ids=[local_rank] on GPU / None on CPU)`` when ``WORLD_SIZE > 1``, and ``torch.compile`` around
the DDP module with ``--compile``. The weights are identical on every rank (seed 0; DDP also
broadcasts rank 0's); each rank draws its own random batch (same shapes; batch seed ``1 + rank``),
so the per-step gradient all-reduce is real work on distinct gradients. Timing: after the warm-up
steps a device sync + barrier on the control group, per-step CUDA events (``perf_counter`` on CPU)
over ``--steps`` steps, then sync + barrier again; ``timed_wall_s`` is that barrier-to-barrier window.
Per-rank results are gathered (``all_gather_object`` on the control group) and rank 0 prints and
writes, per configuration, ``row["ddp"]``:

    world_size, backend, per_rank (rank, tokens_per_s = L / median step, step_ms, peak_mem_gib, ...),
    per_gpu_tokens_per_s  = mean over ranks of tokens_per_s          [tokens/s per GPU]
    total_tokens_per_s    = sum over ranks of tokens_per_s           [tokens/s, all GPUs]
    total_tokens_per_s_wall = world * L * steps / max_rank(timed_wall_s)
    params_identical_across_ranks: the float64 sum and sum of squares of the trainable weights
        after the timed steps agree exactly on all ranks (DDP kept the replicas in sync)
    with --baseline-json (a single-process run of this script at the same shape, compile,
    checkpoint_logits and autocast):
    scaling_efficiency      = per_gpu_tokens_per_s / baseline tokens_per_s   (goal >= 0.9)
    scaling_efficiency_wall = total_tokens_per_s_wall / world / baseline tokens_per_s

NVLink multicast stays off: ``NCCL_NVLS_ENABLE=0`` (forced), ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` and
``NVSHMEM_DISABLE_NVLS=1`` are set before the process group starts. On an N-GPU box, the 1-GPU baseline, then the
N-GPU DDP run compared against it::

    python3 bench/train_throughput.py --kv-heads 64 --steps 10 --warmup 3 --json $OUT/tt1.json
    python3 -m torch.distributed.run --standalone --nproc_per_node 8 bench/train_throughput.py \\
        --kv-heads 64 --steps 10 --warmup 3 --baseline-json $OUT/tt1.json --json $OUT/tt8.json

CPU DDP smoke run (gloo, two processes)::

    python bench/train_throughput.py --tiny --device cpu --json /tmp/tt1.json
    torchrun --standalone --nproc_per_node 2 bench/train_throughput.py --tiny --device cpu \\
        --baseline-json /tmp/tt1.json --json /tmp/tt2.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle3.config import TrainConfig  # noqa: E402
from eagle3.drafter.args import DrafterArgs
from eagle3.drafter.model import Eagle3Drafter  # noqa: E402
from eagle3.io import atomic_write_json  # noqa: E402
from eagle3.losses.ttt import compute_targets  # noqa: E402
from eagle3.process_group import Dist, process_group_scope  # noqa: E402
from eagle3.train.inputs import autocast_dtype  # noqa: E402
from eagle3.train.loop import TARGET_CHUNK, TTTObjective, backward_step  # noqa: E402
from eagle3.train.ranks import init_distributed  # noqa: E402
from eagle3.train.schedule import build_scheduler  # noqa: E402

GIB = 1024**3


@dataclass(frozen=True)
class Shape:
    """Drafter + verifier shape of one benchmark configuration (all sizes in elements).

    ``hidden`` H (drafter width = verifier embedding width), ``heads`` nh, ``kv_heads`` kvh,
    ``head_dim`` hd, ``intermediate`` I (SwiGLU), ``draft_vocab`` draft_V, ``target_vocab`` V
    (verifier LM head rows), ``target_hidden`` Ht (width of each aux state and of the last state),
    ``seq`` L (tokens per sample, batch 1), ``ttt`` K (TTT steps).
    """

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    draft_vocab: int
    target_vocab: int
    target_hidden: int
    seq: int
    ttt: int


# Kimi-K2.5 drafter (configs/kimi-k2.5.yaml): one Llama layer on a 7168-wide residual stream.
REFERENCE = Shape(
    hidden=7168,
    heads=64,
    kv_heads=64,
    head_dim=128,
    intermediate=18432,
    draft_vocab=32000,
    target_vocab=163840,
    target_hidden=7168,
    seq=4096,
    ttt=7,
)
# A CPU smoke shape with the same structure (GQA allowed: heads 8).
TINY = Shape(
    hidden=64,
    heads=8,
    kv_heads=8,
    head_dim=8,
    intermediate=128,
    draft_vocab=96,
    target_vocab=320,
    target_hidden=48,
    seq=48,
    ttt=3,
)


def train_step_flops(s: Shape) -> dict[str, int]:
    """Model FLOPs of one training step (batch 1) at shape ``s``; the formula is in the module docstring.

    Returns:
        dict of exact integers: ``matmul_params_per_ttt_step`` (P_step), ``fc_params`` (P_fc),
        ``dense``, ``attention_causal``, ``attention_diagonal``, ``target_head`` and ``total`` (FLOPs).
    """
    L, H, Ht, K = s.seq, s.hidden, s.target_hidden, s.ttt
    nh, kvh, hd = s.heads, s.kv_heads, s.head_dim
    p_step = 2 * H * (nh + 2 * kvh) * hd + nh * hd * H + 3 * H * s.intermediate + H * s.draft_vocab
    p_fc = 3 * Ht * H
    dense = 6 * L * (K * p_step + p_fc)
    causal = 3 * K * (4 * L * L // 2 * nh * hd)  # L*L even for every L: 4*L*L/2 = 2*L*L
    diag = 3 * sum(4 * L * i * nh * hd for i in range(K))
    target = 2 * Ht * s.target_vocab * L
    return {
        "matmul_params_per_ttt_step": p_step,
        "fc_params": p_fc,
        "dense": dense,
        "attention_causal": causal,
        "attention_diagonal": diag,
        "target_head": target,
        "total": dense + causal + diag + target,
    }


# ---------------------------------------------------------------------------------------------
# timing helpers
# ---------------------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_matmul_ceiling(
    device: torch.device, n: int, dtype: torch.dtype, warmup: int = 3, iters: int = 10
) -> dict:
    """Measured dense matmul rate: ``[n, n] @ [n, n]`` in ``dtype``, mean of ``iters`` after ``warmup``.

    Returns:
        dict ``n``, ``dtype``, ``mean_ms`` (one product), ``tflops`` (``2 n^3 / mean`` in 1e12 FLOP/s).
    """
    g = torch.Generator(device="cpu").manual_seed(1)
    a = torch.randn(n, n, generator=g).to(device, dtype)  # [n, n]
    b = torch.randn(n, n, generator=g).to(device, dtype)  # [n, n]
    for _ in range(warmup):
        c = a @ b  # [n, n]
    _sync(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            c = a @ b  # [n, n]
        end.record()
        torch.cuda.synchronize(device)
        mean_s = start.elapsed_time(end) / 1e3 / iters
    else:
        t0 = time.perf_counter()
        for _ in range(iters):
            c = a @ b  # [n, n]
        mean_s = (time.perf_counter() - t0) / iters
    del a, b, c
    return {
        "n": n,
        "dtype": str(dtype).replace("torch.", ""),
        "mean_ms": mean_s * 1e3,
        "tflops": 2 * n**3 / mean_s / 1e12,
    }


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak_gib(device: torch.device) -> float:
    """Peak memory in GiB: ``torch.cuda.max_memory_allocated`` on GPU; on CPU the process's max RSS
    (``getrusage``; it never resets, so it is an upper bound for the current configuration)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / GIB
    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return rss_kib * 1024 / GIB


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# one configuration
# ---------------------------------------------------------------------------------------------
def build_step(
    s: Shape,
    device: torch.device,
    compile_objective: bool,
    checkpoint_logits: Optional[bool],
    total_steps: int,
    seed: int = 0,
    ddp: Optional[Dist] = None,
    batch_seed: Optional[int] = None,
) -> tuple[Callable[[], torch.Tensor], dict, Callable[[], list[float]]]:
    """Build the drafter, optimizer, scheduler, verifier head and random batch; return ``(step, info, checksum)``.

    ``step()`` runs one full optimizer step (targets, forward, backward, clip, AdamW, LR step) and
    returns the detached scalar loss tensor (no host sync). ``info`` records the settings used:
    ``autocast`` dtype (None = float32), ``checkpoint_logits``, ``trainable_params``, the
    ``TrainConfig`` hyper-parameters, ``ddp_wrapped`` (whether the objective is DDP-wrapped).
    ``checksum()`` returns ``[sum, sum of squares]`` of the trainable weights in float64 (host sync).

    Args:
        seed: drafter init, vocab map and verifier head (identical on every rank).
        ddp: with a multi-process :class:`eagle3.process_group.Dist`, the objective is wrapped in
            ``DistributedDataParallel`` as in ``eagle3.stages.train._run`` (before ``torch.compile``).
        batch_seed: seed of the random batch (``input_ids``, ``aux``, ``last``); None draws it from
            the ``seed`` stream after the head (the single-process default).
    """
    tc = TrainConfig()
    amp = autocast_dtype(tc.bf16, device)  # bf16 on GPU, None on CPU (as train.py)
    feat_dtype = torch.bfloat16 if amp is not None else torch.float32
    ckpt_logits = (
        (device.type == "cuda") if checkpoint_logits is None else checkpoint_logits
    )  # train.py: GPU only
    args = DrafterArgs(
        hidden_size=s.hidden,
        num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads,
        head_dim=s.head_dim,
        intermediate_size=s.intermediate,
        rms_norm_eps=1e-6,
        rope_theta=50000.0,
        max_position_embeddings=max(s.seq + s.ttt, 4096),
        draft_vocab_size=s.draft_vocab,
        target_vocab_size=s.target_vocab,
        target_hidden_size=s.target_hidden,
    )
    torch.manual_seed(seed)
    g = torch.Generator(device="cpu").manual_seed(seed)
    with torch.device(
        device
    ):  # allocate (and N(0, 0.02)-initialise) the float32 master weights on the device
        drafter = Eagle3Drafter(args)
    draft_ids = (
        torch.randperm(s.target_vocab, generator=g)[: s.draft_vocab].sort().values
    )  # [draft_V] verifier ids
    d2t = draft_ids - torch.arange(s.draft_vocab)  # [draft_V] int64 offsets
    t2d = torch.zeros(s.target_vocab, dtype=torch.bool)  # [V]
    t2d[draft_ids] = True
    drafter.set_vocab_map(d2t.to(device), t2d.to(device))
    drafter.train()
    d2t_dev, t2d_dev = d2t.to(device), t2d.to(device)
    head_lm = (torch.randn(s.target_vocab, s.target_hidden, generator=g) * 0.02).to(
        device, feat_dtype
    )  # [V, Ht]

    L = s.seq
    gb = g if batch_seed is None else torch.Generator(device="cpu").manual_seed(batch_seed)
    input_ids = torch.randint(0, s.target_vocab, (1, L), generator=gb).to(device)  # [1, L] int64
    aux = torch.randn(1, L, 3 * s.target_hidden, generator=gb).to(device, feat_dtype)  # [1, L, 3Ht]
    last = torch.randn(1, L, s.target_hidden, generator=gb).to(device, feat_dtype)  # [1, L, Ht]
    loss_mask = torch.ones(1, L, dtype=torch.long, device=device)  # [1, L]

    objective = TTTObjective(drafter, s.ttt, tc.step_weight, checkpoint_logits=ckpt_logits)
    model = objective
    wrapped = ddp is not None and ddp.distributed
    if wrapped:  # as eagle3.stages.train._run: DDP around the objective, torch.compile around DDP
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(objective, device_ids=[device.index] if device.type == "cuda" else None)
    if compile_objective:
        model = torch.compile(model)
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        params, lr=tc.lr, weight_decay=tc.weight_decay, fused=device.type == "cuda"
    )  # as train.py
    scheduler = build_scheduler(optimizer, total_steps, tc.warmup_ratio)

    dinfo = ddp if wrapped else Dist(rank=0, world=1, local_rank=0, device=device)
    batch = {"input_ids": input_ids, "aux": aux, "loss_mask": loss_mask}
    weights = torch.tensor([tc.step_weight**i for i in range(s.ttt)], device=device)  # [K]

    def step() -> torch.Tensor:
        with torch.no_grad():
            tg = compute_targets(
                last, head_lm, d2t_dev, t2d_dev, norm_weight=None, chunk=TARGET_CHUNK
            )  # [1, L, dV] f32, [1, L] bool, [1, L] int64
        (stats,) = backward_step(model, [batch], [tg], s.ttt, dinfo, amp)  # dict of [K]
        torch.nn.utils.clip_grad_norm_(params, tc.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        return (
            weights * stats["loss"]
        ).sum()  # this rank's TTT loss (per-step token means), no host sync

    def checksum() -> list[float]:
        tot = torch.zeros((), dtype=torch.float64, device=device)
        sq = torch.zeros((), dtype=torch.float64, device=device)
        with torch.no_grad():
            for p in params:
                for c in p.detach().reshape(-1).split(1 << 24):  # bounded f64 temporaries (128 MiB)
                    c = c.double()  # [<= 2^24] f64
                    tot += c.sum()
                    sq += c.square().sum()
        return [float(tot), float(sq)]

    info = {
        "autocast": None if amp is None else str(amp).replace("torch.", ""),
        "checkpoint_logits": ckpt_logits,
        "compile": compile_objective,
        "trainable_params": sum(p.numel() for p in params),
        "frozen_params": sum(p.numel() for p in drafter.parameters() if not p.requires_grad),
        "lr": tc.lr,
        "weight_decay": tc.weight_decay,
        "grad_clip": tc.grad_clip,
        "step_weight": tc.step_weight,
        "ddp_wrapped": wrapped,
    }
    return step, info, checksum


def _barrier(d: Optional[Dist]) -> None:
    """Barrier on the gloo control group (no GPU work) when running multi-process; else nothing."""
    if d is not None and d.distributed:
        dist.barrier(group=d.ctrl_group)


def run_config(
    s: Shape,
    device: torch.device,
    warmup: int,
    steps: int,
    compile_objective: bool,
    checkpoint_logits: Optional[bool],
    ceiling_tflops: float,
    ddp: Optional[Dist] = None,
    baseline: Optional[dict] = None,
) -> dict:
    """Build, warm up (the first warm-up step includes compilation), time ``steps`` steps; one result row.

    Row fields: the shape, ``step_ms`` (median; CUDA events on GPU, ``perf_counter`` on CPU),
    ``step_ms_all``, ``tokens_per_s`` (``L / median``), ``first_step_s`` (incl. compilation and
    lazy AdamW state creation), ``compile_s`` (``first_step_s - median``, only with ``--compile``),
    ``peak_mem_gib`` (over the timed steps) and ``peak_mem_gib_incl_warmup``, ``flops``
    (:func:`train_step_flops`), ``tflops_achieved``, ``mfu`` (vs ``ceiling_tflops``), ``loss``,
    ``timed_wall_s`` (wall seconds of the timed steps, sync to sync).

    Under torchrun (``ddp`` given) these fields are this rank's; the rank's batch has seed
    ``1 + rank``, the timed window is framed by device sync + control-group barriers, and
    ``row["ddp"]`` is :func:`ddp_summary` over all ranks (``baseline``: the matching
    single-process row for the scaling efficiency, or None). Every rank must call this together.
    """
    _free(device)
    _reset_peak(device)
    t0 = time.perf_counter()
    step, info, checksum = build_step(
        s,
        device,
        compile_objective,
        checkpoint_logits,
        total_steps=warmup + steps,
        ddp=ddp,
        batch_seed=None if ddp is None else 1 + ddp.rank,
    )
    _sync(device)
    build_s = time.perf_counter() - t0

    first_s = None
    loss = None
    for w in range(warmup):
        t0 = time.perf_counter()
        loss = step()
        _sync(device)
        if w == 0:
            first_s = time.perf_counter() - t0
    peak_warm = _peak_gib(device)
    _reset_peak(device)
    times = []
    _barrier(ddp)  # all ranks start the timed window together (device already synced)
    t_wall = time.perf_counter()
    if device.type == "cuda":
        evs = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(steps)
        ]
        for a, b in evs:
            a.record()
            loss = step()
            b.record()
        torch.cuda.synchronize(device)
        times = [a.elapsed_time(b) / 1e3 for a, b in evs]
    else:
        for _ in range(steps):
            t0 = time.perf_counter()
            loss = step()
            times.append(time.perf_counter() - t0)
    _barrier(ddp)  # the window ends when the slowest rank is done
    wall_s = time.perf_counter() - t_wall
    med = statistics.median(times)
    peak = _peak_gib(device)
    flops = train_step_flops(s)
    achieved = flops["total"] / med / 1e12
    row = {
        **asdict(s),
        "device": str(device),
        **info,
        "build_s": build_s,
        "warmup": warmup,
        "steps": steps,
        "step_ms": med * 1e3,
        "step_ms_all": [t * 1e3 for t in times],
        "tokens_per_s": s.seq / med,
        "first_step_s": first_s,
        "compile_s": (first_s - med) if (compile_objective and first_s is not None) else None,
        "peak_mem_gib": peak,
        "peak_mem_gib_incl_warmup": max(peak, peak_warm),
        "flops": flops,
        "tflops_achieved": achieved,
        "mfu": achieved / ceiling_tflops,
        "loss": float(loss) if loss is not None else None,
        "oom": False,
        "timed_wall_s": wall_s,
    }
    if ddp is not None:
        mine = {
            "rank": ddp.rank,
            "local_rank": ddp.local_rank,
            "device": str(device),
            "device_name": torch.cuda.get_device_name(device)
            if device.type == "cuda"
            else platform.machine(),
            "tokens_per_s": row["tokens_per_s"],
            "step_ms": row["step_ms"],
            "step_ms_all": row["step_ms_all"],
            "timed_wall_s": wall_s,
            "peak_mem_gib": peak,
            "mfu": row["mfu"],
            "loss": row["loss"],
            "param_checksum": checksum(),
        }
        ranks = [mine]
        if ddp.distributed:
            ranks = [None] * ddp.world
            dist.all_gather_object(ranks, mine, group=ddp.ctrl_group)
        row["ddp"] = ddp_summary(
            ranks, s.seq, steps, baseline, backend=dist.get_backend() if ddp.distributed else None
        )
    return row


GOAL_EFFICIENCY = 0.9  # the target: per-GPU rate >= 90% of the 1-GPU rate


def ddp_summary(
    ranks: list[dict], seq: int, steps: int, baseline: Optional[dict], backend: Optional[str]
) -> dict:
    """Combine the gathered per-rank results of one configuration (formulas in the module docstring).

    Args:
        ranks: one dict per rank, in rank order, with ``tokens_per_s`` (tokens/s of that rank),
            ``timed_wall_s`` (s) and ``param_checksum`` (``[sum, sum of squares]``).
        seq: tokens per rank per step (L). steps: timed steps.
        baseline: the matching single-process row (its ``tokens_per_s`` is the 1-GPU rate) with a
            ``source`` path added, or None (no efficiency).

    Returns:
        dict ``world_size``, ``backend``, ``per_rank``, ``per_gpu_tokens_per_s`` (mean),
        ``min_rank_tokens_per_s``, ``max_rank_tokens_per_s``, ``total_tokens_per_s`` (sum),
        ``timed_wall_s`` (max over ranks), ``total_tokens_per_s_wall``, ``params_identical_across_ranks``,
        and with a baseline ``baseline`` (source, tokens_per_s, step_ms, device), ``scaling_efficiency``,
        ``scaling_efficiency_wall``, ``goal_efficiency`` and ``meets_goal``.
    """
    world = len(ranks)
    rates = [float(r["tokens_per_s"]) for r in ranks]  # tokens/s per rank
    wall = max(float(r["timed_wall_s"]) for r in ranks)  # s
    out = {
        "world_size": world,
        "backend": backend,
        "per_rank": ranks,
        "per_gpu_tokens_per_s": sum(rates) / world,
        "min_rank_tokens_per_s": min(rates),
        "max_rank_tokens_per_s": max(rates),
        "total_tokens_per_s": sum(rates),
        "timed_wall_s": wall,
        "total_tokens_per_s_wall": world * seq * steps / wall,
        "params_identical_across_ranks": all(
            r["param_checksum"] == ranks[0]["param_checksum"] for r in ranks
        ),
    }
    if baseline is not None:
        base = float(baseline["tokens_per_s"])
        out["baseline"] = {
            "source": baseline.get("source"),
            "tokens_per_s": base,
            "step_ms": baseline.get("step_ms"),
            "device": baseline.get("device"),
        }
        out["scaling_efficiency"] = out["per_gpu_tokens_per_s"] / base
        out["scaling_efficiency_wall"] = out["total_tokens_per_s_wall"] / world / base
        out["goal_efficiency"] = GOAL_EFFICIENCY
        out["meets_goal"] = out["scaling_efficiency"] >= GOAL_EFFICIENCY
    return out


_MATCH_KEYS = tuple(Shape.__dataclass_fields__) + ("compile", "checkpoint_logits", "autocast")


def find_baseline_row(baseline: dict, want: dict, source: str) -> dict:
    """The single-process row of a ``--json`` result that matches ``want`` on :data:`_MATCH_KEYS`.

    Args:
        baseline: the parsed JSON of a throughput run of this script (one process).
        want: the shape fields plus the resolved ``compile``, ``checkpoint_logits`` and ``autocast``.
        source: the file name, for messages and the returned row's ``source``.

    Raises:
        ValueError: not a throughput result, a multi-process result, or no matching non-OOM row.
    """
    if (
        not isinstance(baseline, dict)
        or baseline.get("mode") != "throughput"
        or not isinstance(baseline.get("runs"), list)
    ):
        raise ValueError(
            f"{source}: not a throughput result of bench/train_throughput.py (key 'mode'/'runs')"
        )
    if int(baseline.get("world_size", 1)) != 1:
        raise ValueError(
            f"{source}: key 'world_size' is {baseline['world_size']}; the baseline must be a 1-GPU run"
        )
    have = []
    for r in baseline["runs"]:
        if not isinstance(r, dict) or r.get("oom", True):
            continue
        got = {k: r.get(k) for k in _MATCH_KEYS}
        if got == want:
            return {**r, "source": source}
        have.append(got)
    raise ValueError(f"{source}: no run matches {want}; it has {have or 'no successful runs'}")


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()


def run_guarded(s: Shape, device: torch.device, **kw) -> dict:
    """:func:`run_config`, but an out-of-memory error becomes a row with ``oom: True`` (memory freed)."""
    err = None
    try:
        return run_config(s, device, **kw)
    except (torch.cuda.OutOfMemoryError, RuntimeError, MemoryError) as e:
        if not _is_oom(e) and not isinstance(e, MemoryError):
            raise
        err = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    finally:
        if kw.get("compile_objective"):
            torch._dynamo.reset()
    _free(device)
    return {
        **asdict(s),
        "device": str(device),
        "oom": True,
        "error": err,
        "peak_mem_gib": _peak_gib(device),
        "flops": train_step_flops(s),
    }


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------
def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def markdown(result: dict) -> str:
    """Markdown table of the result rows plus the ceiling and FLOP sanity lines."""
    c = result["ceiling"]
    ref = result["reference_flops"]
    lines = [
        f"matmul ceiling: {c['tflops']:.4g} TFLOP/s ({c['n']}^3 {c['dtype']}, mean of 10 after 3 warm-ups, {c['mean_ms']:.3f} ms)",
        f"reference-shape FLOPs/step (64 KV heads, L 4096, ttt 7): {ref['total']:.4e} (issue: ~1.98e14); "
        f"with 8 KV heads: {result['reference_flops_kv8']['total']:.4e}",
        "",
    ]
    search = result["mode"] == "max_seq_search"
    head = [
        "seq",
        "kv heads",
        "ttt",
        "compile",
        "ckpt logits",
        "step ms",
        "tokens/s",
        "peak GiB",
        "FLOPs/step",
        "TFLOP/s",
        "MFU",
    ]
    if search:
        head += [f"fits {result['mem_budget_gib']:g} GiB"]
    else:
        head += ["compile s"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for r in result["runs"]:
        cells = [
            str(r["seq"]),
            str(r["kv_heads"]),
            str(r["ttt"]),
            str(r.get("compile", "-")),
            str(r.get("checkpoint_logits", "-")),
            "OOM" if r["oom"] else _fmt(r["step_ms"], ".1f"),
            "-" if r["oom"] else _fmt(r["tokens_per_s"], ".0f"),
            _fmt(r["peak_mem_gib"], ".2f"),
            f"{r['flops']['total']:.4e}",
            "-" if r["oom"] else _fmt(r["tflops_achieved"], ".4g"),
            "-" if r["oom"] else _fmt(r["mfu"], ".3f"),
        ]
        cells += [str(r["fits"])] if search else [_fmt(r.get("compile_s"), ".1f")]
        lines.append("| " + " | ".join(cells) + " |")
    ddp_rows = [r for r in result["runs"] if r.get("ddp")]
    if ddp_rows:
        lines += [
            "",
            f"DDP: {result.get('world_size')} processes, backend {ddp_rows[0]['ddp']['backend']}; "
            "step ms / tokens/s above are rank 0's; efficiency = per-GPU tokens/s / 1-GPU tokens/s "
            f"(goal >= {GOAL_EFFICIENCY:g})",
            "",
        ]
        head = [
            "world",
            "seq",
            "kv heads",
            "compile",
            "per-GPU tok/s",
            "min rank tok/s",
            "total tok/s",
            "total tok/s (wall)",
            "1-GPU tok/s",
            "efficiency",
            "eff. (wall)",
            "params in sync",
        ]
        lines += ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
        for r in ddp_rows:
            q = r["ddp"]
            base = q.get("baseline", {}).get("tokens_per_s")
            lines.append(
                "| "
                + " | ".join(
                    [
                        str(q["world_size"]),
                        str(r["seq"]),
                        str(r["kv_heads"]),
                        str(r["compile"]),
                        _fmt(q["per_gpu_tokens_per_s"], ".0f"),
                        _fmt(q["min_rank_tokens_per_s"], ".0f"),
                        _fmt(q["total_tokens_per_s"], ".0f"),
                        _fmt(q["total_tokens_per_s_wall"], ".0f"),
                        _fmt(base, ".0f"),
                        _fmt(q.get("scaling_efficiency"), ".3f"),
                        _fmt(q.get("scaling_efficiency_wall"), ".3f"),
                        str(q["params_identical_across_ranks"]),
                    ]
                )
                + " |"
            )
    return "\n".join(lines)


def _nvls_off() -> None:
    """Keep NVLink multicast off for NCCL / symmetric memory / NVSHMEM (before any process group)."""
    if os.environ.get("NCCL_NVLS_ENABLE", "0") != "0":
        print(
            f"NCCL_NVLS_ENABLE={os.environ['NCCL_NVLS_ENABLE']} overridden to 0 (no NVLink multicast)",
            file=sys.stderr,
        )
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--seq", type=int, default=None, help="tokens per sample (default 4096; --tiny 48)"
    )
    p.add_argument(
        "--kv-heads",
        type=int,
        nargs="+",
        default=None,
        help="one or more KV-head counts, one run each (default: 64 = the reference's MHA shape; --tiny 8)",
    )
    p.add_argument("--ttt", type=int, default=None, help="TTT steps (default 7; --tiny 3)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 5; --tiny 2)")
    p.add_argument(
        "--warmup", type=int, default=None, help="untimed steps first (default 2; --tiny 1)"
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the TTTObjective (compile time reported)",
    )
    p.add_argument(
        "--checkpoint-logits",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="recompute the per-step logits in backward (default: as train.py, on for CUDA only)",
    )
    p.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default cuda if available)")
    p.add_argument("--tiny", action="store_true", help="a tiny shape for a CPU smoke run")
    p.add_argument(
        "--ceiling-n",
        type=int,
        default=None,
        help="matmul size of the ceiling (default 8192 GPU, 512 CPU)",
    )
    p.add_argument(
        "--max-seq-search", action="store_true", help="try --search-seqs against --mem-budget-gib"
    )
    p.add_argument(
        "--search-seqs",
        type=int,
        nargs="+",
        default=None,
        help="lengths to try (default 8192; --tiny 96)",
    )
    p.add_argument(
        "--mem-budget-gib", type=float, default=96.0, help="budget for --max-seq-search (GiB)"
    )
    p.add_argument("--json", type=Path, default=None, help="also write the result here")
    p.add_argument(
        "--baseline-json",
        type=Path,
        default=None,
        help="under torchrun: a 1-GPU --json result at the same settings; adds the scaling efficiency",
    )
    a = p.parse_args(argv)

    launched = (
        "RANK" in os.environ and "WORLD_SIZE" in os.environ
    )  # torchrun (or equivalent) environment
    ddp_info: Optional[Dist] = None
    if launched:
        if a.max_seq_search:
            p.error(
                "--max-seq-search is single-process only (an OOM on one rank would hang the others)"
            )
        if a.device not in (None, "cpu", "cuda"):
            p.error(
                f"--device {a.device}: under torchrun each rank uses cuda:LOCAL_RANK; pass cuda or cpu"
            )
        if a.device == "cuda" and not torch.cuda.is_available():
            p.error("--device cuda: CUDA is not available")
    elif a.baseline_json is not None:
        p.error("--baseline-json needs a torchrun launch (RANK / WORLD_SIZE in the environment)")
    baseline = None
    if a.baseline_json is not None:
        try:
            baseline = json.loads(a.baseline_json.read_text())
        except (OSError, ValueError) as e:
            p.error(f"--baseline-json {a.baseline_json}: {e}")

    if launched:
        _nvls_off()
        ddp_info = init_distributed(
            "cpu" if a.device == "cpu" else None
        )  # NCCL on cuda:LOCAL_RANK, else gloo
        device = ddp_info.device
    else:
        device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if device.type == "cuda":
            if device.index is None:  # torch 2.11 rejects an index-less device in set_device
                device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(device)
    owned = ddp_info is not None and ddp_info.initialized_here
    with process_group_scope(
        ddp_info.ctrl_group if owned else None, owned=owned
    ):  # barrier on success only
        return _main(p, a, device, ddp_info, baseline)


def _main(
    p: argparse.ArgumentParser,
    a: argparse.Namespace,
    device: torch.device,
    ddp_info: Optional[Dist],
    baseline: Optional[dict],
) -> int:
    """The benchmark after argument parsing and (under torchrun) process-group start; rank 0 reports."""
    main_rank = ddp_info is None or ddp_info.is_main
    base = TINY if a.tiny else REFERENCE
    base = replace(base, **{k: v for k, v in (("seq", a.seq), ("ttt", a.ttt)) if v is not None})
    kv_list = a.kv_heads or [base.kv_heads]
    for kvh in kv_list:
        if kvh < 1 or base.heads % kvh:
            p.error(f"--kv-heads {kvh} must divide the {base.heads} attention heads")
    steps = a.steps if a.steps is not None else (2 if a.tiny else 5)
    warmup = a.warmup if a.warmup is not None else (1 if a.tiny else 2)
    if a.max_seq_search:
        seqs = a.search_seqs or ([96] if a.tiny else [8192])
        steps, warmup = (a.steps or 1), (a.warmup if a.warmup is not None else 1)
    else:
        seqs = [base.seq]
    if steps < 1 or warmup < 1:
        p.error(
            "--steps and --warmup must be >= 1 (the first warm-up step creates the AdamW state)"
        )

    # ceiling in the dtype the step's matmuls run in: bf16 under autocast (GPU), float32 on CPU
    amp = autocast_dtype(TrainConfig().bf16, device)
    ceil_dtype = amp if amp is not None else torch.float32
    base_rows = {}
    if baseline is not None:  # validate before any heavy work; same error on every rank
        ckpt = (device.type == "cuda") if a.checkpoint_logits is None else a.checkpoint_logits
        for kvh in kv_list:
            s = replace(base, kv_heads=kvh)
            want = {
                **asdict(s),
                "compile": a.compile,
                "checkpoint_logits": ckpt,
                "autocast": None if amp is None else str(amp).replace("torch.", ""),
            }
            try:
                base_rows[kvh] = find_baseline_row(baseline, want, str(a.baseline_json))
            except ValueError as e:
                p.error(f"--baseline-json: {e}")
    ceiling = measure_matmul_ceiling(
        device, a.ceiling_n or (8192 if device.type == "cuda" else 512), ceil_dtype
    )
    _free(device)

    runs = []
    for seq in seqs:
        for kvh in kv_list:
            s = replace(base, seq=seq, kv_heads=kvh)
            kw = dict(
                warmup=warmup,
                steps=steps,
                compile_objective=a.compile,
                checkpoint_logits=a.checkpoint_logits,
                ceiling_tflops=ceiling["tflops"],
            )
            if (
                ddp_info is not None
            ):  # no OOM guard: a rank that survived an OOM would hang in the all-reduce
                row = run_config(s, device, ddp=ddp_info, baseline=base_rows.get(kvh), **kw)
            else:
                row = run_guarded(s, device, **kw)
            if a.max_seq_search:
                row["fits"] = (not row["oom"]) and row["peak_mem_gib"] <= a.mem_budget_gib
            runs.append(row)
            if not main_rank:
                continue
            print(
                f"seq {seq} kv_heads {kvh}: "
                + (
                    "OOM"
                    if row["oom"]
                    else f"{row['step_ms']:.1f} ms/step, {row['tokens_per_s']:.0f} tok/s, peak {row['peak_mem_gib']:.2f} GiB, "
                    f"MFU {row['mfu']:.3f}"
                )
                + (
                    ""
                    if "ddp" not in row
                    else f"; {row['ddp']['world_size']} ranks: {row['ddp']['per_gpu_tokens_per_s']:.0f} tok/s per GPU, "
                    f"efficiency {_fmt(row['ddp'].get('scaling_efficiency'), '.3f')}"
                ),
                file=sys.stderr,
                flush=True,
            )

    if not main_rank:
        return 0
    env = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device_name": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or platform.machine(),
        "cpu_threads": torch.get_num_threads(),
    }
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        env["transformers"] = None
    env.update(
        {
            k: os.environ.get(k)
            for k in (
                "NCCL_NVLS_ENABLE",
                "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                "NVSHMEM_DISABLE_NVLS",
            )
        }
    )
    result = {
        "mode": "max_seq_search" if a.max_seq_search else "throughput",
        "tiny": a.tiny,
        "env": env,
        "world_size": 1 if ddp_info is None else ddp_info.world,
        "torchrun": ddp_info is not None,
        "baseline_json": None if a.baseline_json is None else str(a.baseline_json),
        "ceiling": ceiling,
        "reference_flops": train_step_flops(REFERENCE),
        "reference_flops_kv8": train_step_flops(replace(REFERENCE, kv_heads=8)),
        "mem_budget_gib": a.mem_budget_gib if a.max_seq_search else None,
        "runs": runs,
    }
    print(markdown(result))
    print(json.dumps(result, indent=2))
    if a.json is not None:
        atomic_write_json(a.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
