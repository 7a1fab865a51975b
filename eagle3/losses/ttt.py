"""Training-time test (TTT): the attention pattern, the verifier targets and the EAGLE-3 loss.

All indexing follows DESIGN.md "TTT indexing": drafter step ``i`` at position ``t`` predicts
``x_{t+2+i}``; its target is the verifier distribution ``p_{t+1+i}`` restricted to the draft
vocabulary and renormalised; it is counted iff ``t+2+i <= L-1``, ``loss_mask[t+2+i] == 1`` and the
verifier's full-vocab argmax at ``t+1+i`` lies in the draft vocabulary. Step ``i`` is weighted
``step_weight ** i`` (0.8 in the EAGLE-3 paper, arXiv 2503.01840, and SpecForge).

Normalisation over an optimizer step (DESIGN.md "Loss normalisation"): the loss of step ``i`` is the
sum of the per-token cross-entropies over the counted positions of the WHOLE optimizer step (every
micro-batch of gradient accumulation, every DDP rank) divided by the number of those positions. A
trainer counts them up front with :func:`ttt_token_counts`, turns the counts of all its micro-batches
into per-step denominators with :func:`step_denominators` (one all-reduce per optimizer step), and
passes them to :func:`ttt_loss` as ``denom``; the gradient is then independent of how the step's
samples are split into micro-batches and ranks.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch.utils.checkpoint import checkpoint as _checkpoint

from eagle3.losses.token import LK_ETA, token_loss


class TTTTargets(NamedTuple):
    """Verifier targets for one batch, computed once per token (see :func:`compute_targets`)."""

    logp_draft: (
        torch.Tensor
    )  # [B, L, draft_V] float32 log-probs over the draft vocab (renormalised)
    in_draft: torch.Tensor  # [B, L] bool: full-vocab argmax is in the draft vocab
    argmax: torch.Tensor  # [B, L] int64: full-vocab argmax (verifier id)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama RMSNorm in float32, cast back to ``x.dtype`` before the weight (HF ``LlamaRMSNorm``)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


@torch.no_grad()
def compute_targets(
    last_hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    d2t: torch.Tensor,
    t2d: torch.Tensor,
    norm_weight: Optional[torch.Tensor] = None,
    norm_eps: float = 1e-6,
    chunk: int = 1024,
) -> TTTTargets:
    """Verifier next-token targets from its last hidden state, restricted to the draft vocab.

    ``logits = lm_head(norm(last))`` (the norm only when ``norm_weight`` is given, i.e. the captured
    last state is pre-norm; HF ``hidden_states[-1]`` of Llama is already post-norm). The matmul runs
    in ``lm_head_weight``'s dtype and is read in float32. Processed ``chunk`` tokens at a time so that
    full-vocab logits exist for at most ``chunk`` tokens.

    Args:
        last_hidden: ``[B, L, Ht]`` verifier last hidden state.
        lm_head_weight: ``[V, Ht]``.
        d2t: int64 ``[draft_V]`` offsets (draft id ``d`` is verifier id ``d + d2t[d]``).
        t2d: bool ``[V]``.
        norm_weight: ``[Ht]`` verifier final RMSNorm weight, or None.
        norm_eps: its epsilon.
        chunk: tokens per chunk.

    Returns:
        :class:`TTTTargets` ``(logp_draft [B, L, draft_V] float32, in_draft [B, L] bool, argmax [B, L] int64)``;
        ``logp_draft = log_softmax(logits[..., arange(draft_V) + d2t])``.
    """
    B, L, Ht = last_hidden.shape
    dev = last_hidden.device
    W = lm_head_weight.to(dev)
    cols = torch.arange(d2t.shape[0], device=dev) + d2t.to(
        dev
    )  # [draft_V] verifier ids of draft ids
    t2d = t2d.to(dev)
    flat = last_hidden.reshape(B * L, Ht)  # [N, Ht]
    N = flat.shape[0]
    logp = torch.empty(N, cols.shape[0], dtype=torch.float32, device=dev)  # [N, draft_V]
    amax = torch.empty(N, dtype=torch.long, device=dev)  # [N]
    for s in range(0, N, chunk):
        h = flat[s : s + chunk]  # [n, Ht]
        if norm_weight is not None:
            h = _rms_norm(h, norm_weight.to(dev), norm_eps)
        logits = (h.to(W.dtype) @ W.t()).float()  # [n, V]
        amax[s : s + chunk] = logits.argmax(-1)
        logp[s : s + chunk] = torch.log_softmax(logits[:, cols], dim=-1)  # [n, draft_V]
    return TTTTargets(logp.view(B, L, -1), t2d[amax].view(B, L), amax.view(B, L))


def _valid_positions(loss_mask: torch.Tensor, in_draft: torch.Tensor, i: int) -> torch.Tensor:
    """Counted positions of TTT step ``i``: ``[B, n]`` bool over ``t = 0..n-1`` with ``n = L - 2 - i``
    (``loss_mask[:, t+2+i] == 1`` and ``in_draft[:, t+1+i]``); ``n <= 0`` gives ``[B, 0]``."""
    L = loss_mask.shape[1]
    n = max(L - 2 - i, 0)
    return loss_mask[:, 2 + i : 2 + i + n].bool() & in_draft[:, 1 + i : 1 + i + n].to(
        loss_mask.device
    )


def ttt_token_counts(
    loss_mask: torch.Tensor, in_draft: torch.Tensor, ttt_length: int
) -> torch.Tensor:
    """Number of counted positions of each TTT step in one (micro-)batch, without the drafter.

    The same rule as :func:`ttt_loss` (DESIGN.md "TTT indexing"): step ``i`` counts position ``t``
    iff ``t + 2 + i <= L - 1``, ``loss_mask[:, t+2+i] == 1`` and ``in_draft[:, t+1+i]``.

    Args:
        loss_mask: ``[B, L]`` int/bool, 1 on assistant tokens (0 on padding).
        in_draft: ``[B, L]`` bool, :attr:`TTTTargets.in_draft` of the same batch.
        ttt_length: number of TTT steps ``K``.

    Returns:
        int64 ``[K]`` on ``loss_mask``'s device (no host sync).
    """
    return torch.stack(
        [_valid_positions(loss_mask, in_draft, i).sum() for i in range(ttt_length)]
    )  # [K]


def step_denominators(counts: list[torch.Tensor], world_size: int = 1, group=None) -> torch.Tensor:
    """Per-TTT-step loss denominators for every micro-batch of one optimizer step.

    ``N_i`` = the counted positions of step ``i`` summed over the micro-batches in ``counts`` and,
    when ``world_size > 1``, over all ranks (ONE ``all_reduce`` of a ``[K]`` tensor per optimizer
    step, on ``group``: on CUDA tensors it is queued on the device, no host sync). Returns
    ``max(N_i, 1) / world_size``: a micro-batch loss ``sum_i w**i * S_i / denom_i`` (``S_i`` its
    summed cross-entropy of step ``i``) then makes the DDP-averaged, micro-batch-summed gradient equal
    the gradient of ``sum_i w**i * (sum of all S_i) / N_i`` (DDP divides gradients by ``world_size``,
    which the denominator multiplies back). Steps with no counted position anywhere contribute 0.

    Args:
        counts: :func:`ttt_token_counts` of each micro-batch of this rank (int64 ``[K]`` each).
        world_size: number of DDP ranks (every rank must call this, with the same ``K``).
        group: ``torch.distributed`` process group (None = the default group).

    Returns:
        float32 ``[K]`` on the device of ``counts``.
    """
    total = torch.stack(list(counts)).sum(0).to(torch.float64)  # [K]
    if world_size > 1:
        import torch.distributed as dist

        dist.all_reduce(total, group=group)
    return (total.clamp(min=1) / world_size).float()  # [K]


def draft_index(target_ids: torch.Tensor, d2t: torch.Tensor) -> torch.Tensor:
    """Draft ids of verifier ids ``target_ids`` (any shape, int64): the position in the sorted draft vocab
    ``arange(draft_V) + d2t``; ids outside the draft vocab get an arbitrary valid index (never counted)."""
    cols = torch.arange(d2t.shape[0], device=d2t.device) + d2t  # [draft_V] ascending verifier ids
    return torch.searchsorted(cols, target_ids.to(cols.device).contiguous()).clamp(
        max=d2t.shape[0] - 1
    )


def _step_terms(
    drafter,
    h: torch.Tensor,
    tgt_logp: torch.Tensor,
    tgt_draft: Optional[torch.Tensor] = None,
    loss: str = "soft_ce",
    lk_eta: float = LK_ETA,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position loss (:func:`eagle3.losses.token.token_loss`) ``[B, n]`` float32 and drafter argmax ``[B, n]`` (draft ids)."""
    logits = drafter.compute_logits(h).float()  # [B, n, draft_V]
    return token_loss(logits, tgt_logp, tgt_draft, loss, lk_eta), logits.argmax(-1)


def step_metrics(
    losses: list[torch.Tensor],
    sums: list[torch.Tensor],
    corrects: list[torch.Tensor],
    counts: list[torch.Tensor],
) -> dict[str, torch.Tensor]:
    """Per-TTT-step metrics as device tensors (no host sync), one entry per step ``[K]``.

    Args: per step i: ``losses[i]`` its (normalised) loss, ``sums[i]`` the summed token cross-entropy,
    ``corrects[i]`` / ``counts[i]`` top-1 hits and counted tokens (0-dim tensors).

    Returns:
        ``{"loss", "ce_sum", "acc" (= correct / max(count, 1)), "correct", "count"}``, each ``[K]``.
    """
    counts_t = torch.stack(counts)  # [K]
    corrects_t = torch.stack(corrects)  # [K]
    return {
        "loss": torch.stack(losses).float(),  # [K]
        "ce_sum": torch.stack(sums).float(),  # [K]
        "acc": corrects_t.float() / counts_t.clamp(min=1).float(),  # [K]
        "correct": corrects_t,
        "count": counts_t,
    }


class StepSums:
    """The TTT loss of one batch, summed step by step (:func:`ttt_loss`, :func:`eagle3.losses.rows.ttt_loss_rows`):
    ``total = sum_i step_weight**i * S_i / D_i`` with ``D_i`` = ``denom[i]`` when given (the optimizer step's,
    :func:`step_denominators`), else ``max(1, count_i)`` (the batch's own mean); :meth:`result` adds the per-step
    metrics (:func:`step_metrics`)."""

    def __init__(self, dev: torch.device, step_weight: float, denom: Optional[torch.Tensor]):
        self.total = torch.zeros((), dtype=torch.float32, device=dev)
        self.step_weight, self.denom = step_weight, denom
        self.losses, self.sums, self.corrects, self.counts = [], [], [], []

    def add(self, i: int, ce: torch.Tensor, valid: torch.Tensor, hit: torch.Tensor) -> None:
        """Step ``i``: per-position loss ``ce``, counted positions ``valid`` (bool), top-1 ``hit`` (bool), same shape."""
        cnt = valid.sum()
        ce_sum = (ce * valid).sum()  # S_i
        step_loss = ce_sum / cnt.clamp(min=1)
        d = self.denom
        self.total = self.total + (self.step_weight**i) * (
            step_loss if d is None else ce_sum / d[i]
        )
        self.losses.append(step_loss.detach())
        self.sums.append(ce_sum.detach())
        self.corrects.append((hit & valid).sum())
        self.counts.append(cnt)

    def add_empty(self) -> None:
        """A step with no position (the sequence is too short for it)."""
        zero = torch.zeros((), device=self.total.device)
        self.losses.append(zero)
        self.sums.append(zero)
        self.corrects.append(zero.long())
        self.counts.append(zero.long())

    def result(self) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return self.total, step_metrics(self.losses, self.sums, self.corrects, self.counts)


def ttt_loss(
    drafter,
    step_hiddens: list[torch.Tensor],
    targets: TTTTargets,
    loss_mask: torch.Tensor,
    step_weight: float = 0.8,
    checkpoint: bool = False,
    compact: Optional[bool] = None,
    denom: Optional[torch.Tensor] = None,
    loss: str = "soft_ce",
    lk_eta: float = LK_ETA,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """EAGLE-3 TTT loss (the reference over every position): weighted sum over steps of the mean per-token loss
    (``loss``, :data:`eagle3.losses.token.LOSSES`). For step ``i`` position ``t`` is valid iff ``t + 2 + i <= L - 1``,
    ``loss_mask[:, t+2+i] == 1`` and ``targets.in_draft[:, t+1+i]``; ``S_i = sum_valid CE(p_{t+1+i}, q_{i,t})`` and
    ``loss = sum_i step_weight**i * S_i / denom_i`` (:class:`StepSums`: this batch's mean over its valid positions,
    or the given ``denom`` of the whole optimizer step). Accuracy of step ``i``: the drafter argmax mapped through
    ``d2t`` equals the verifier's full-vocab argmax at ``t+1+i``, over the valid positions.

    Args:
        drafter: :class:`eagle3.drafter.model.Eagle3Drafter` (uses ``compute_logits`` and ``d2t``).
        step_hiddens: output of ``ttt_forward``.
        targets: :func:`compute_targets` output for the same batch.
        loss_mask: ``[B, L]`` int/bool, 1 on assistant tokens.
        step_weight: weight base (``train.step_weight``).
        checkpoint: activation-checkpoint the logits/CE of each step.
        compact: logits only at the valid positions (same sums; the gather syncs the host, so ``None`` = on for
            CPU tensors only).
        denom: float ``[K]`` per-step denominators (:func:`step_denominators`), or None.
        loss / lk_eta: the per-token loss (:func:`eagle3.losses.token.token_loss`); ``ce_sum`` sums it.

    Returns:
        ``(loss, metrics)``: scalar float32 loss (differentiable) and detached ``[K]`` tensors, no host sync:
        ``loss`` (this batch's mean per step), ``ce_sum`` (``S_i``), ``acc``, ``correct`` and ``count`` (int64).
    """
    B, L = loss_mask.shape
    dev = step_hiddens[0].device
    mask_all = loss_mask.to(dev).bool()  # [B, L]
    acc = StepSums(dev, step_weight, denom)
    for i, h in enumerate(step_hiddens):
        n = L - 2 - i  # positions t = 0..L-3-i satisfy t+2+i <= L-1
        if n <= 0:
            acc.add_empty()
            continue
        valid = _valid_positions(mask_all, targets.in_draft, i)  # [B, n]
        tgt = targets.logp_draft[:, 1 + i : 1 + i + n]  # [B, n, draft_V]
        use_compact = (h.device.type == "cpu") if compact is None else compact
        hs, tgt_am = h[:, :n], targets.argmax[:, 1 + i : 1 + i + n]  # [B, n, H], [B, n]
        if use_compact:
            rows = valid.nonzero(as_tuple=True)  # host sync; -> [Nv, H], [Nv, dV], [Nv], [Nv]
            hs, tgt, tgt_am, valid = (x[rows] for x in (hs, tgt, tgt_am, valid))
        tgt_draft = draft_index(tgt_am, drafter.d2t) if loss == "hard_ce" else None
        if checkpoint and torch.is_grad_enabled():
            ce, pred = _checkpoint(
                _step_terms, drafter, hs, tgt, tgt_draft, loss, lk_eta, use_reentrant=False
            )
        else:
            ce, pred = _step_terms(drafter, hs, tgt, tgt_draft, loss, lk_eta)
        acc.add(i, ce, valid, drafter.draft_to_target(pred) == tgt_am)
    return acc.result()
