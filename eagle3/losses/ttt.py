"""Training-time test (TTT): the verifier targets, the counted positions and the step-normalised EAGLE-3 loss.

Indexing (DESIGN.md "TTT indexing"): step ``i`` at position ``t`` predicts ``x_{t+2+i}`` against the verifier's
``p_{t+1+i}`` restricted to the draft vocab; counted iff ``t+2+i <= L-1``, ``loss_mask[t+2+i]`` and the verifier
argmax at ``t+1+i`` is in the draft vocab; weighted ``step_weight ** i``. Normalisation (DESIGN.md "Loss
normalisation"): step ``i``'s summed loss over the whole optimizer step (micro-batches, ranks) over its count,
via :func:`ttt_token_counts` -> :func:`step_denominators` -> ``denom``.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch.utils.checkpoint import checkpoint as _checkpoint

from eagle3.losses.token import LK_ETA, token_loss


class TTTTargets(NamedTuple):
    """Verifier targets of one batch (:func:`compute_targets`)."""

    logp_draft: torch.Tensor  # [B, L, dV] float32 log-probs over the draft vocab (renormalised)
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
    """Verifier targets from its last hidden state ``[B, L, Ht]``: ``logits = lm_head(norm(last))`` (the RMSNorm only
    when ``norm_weight`` ``[Ht]`` is given: a pre-norm state), matmul in ``lm_head_weight``'s dtype (``[V, Ht]``),
    ``chunk`` tokens at a time. ``d2t`` int64 ``[dV]`` offsets, ``t2d`` bool ``[V]``.

    Returns:
        ``(logp_draft [B, L, dV] float32 = log_softmax(logits[..., arange(dV) + d2t]), in_draft [B, L] bool,
        argmax [B, L] int64)``.
    """
    B, L, Ht = last_hidden.shape
    dev = last_hidden.device
    W = lm_head_weight.to(dev)
    cols = torch.arange(d2t.shape[0], device=dev) + d2t.to(dev)  # [dV] verifier ids of draft ids
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
    """Counted positions of each TTT step (:func:`_valid_positions`): int64 ``[K]`` on ``loss_mask``'s device, no host
    sync. ``loss_mask`` ``[B, L]`` (0 on padding), ``in_draft`` ``[B, L]`` bool.
    """
    return torch.stack(
        [_valid_positions(loss_mask, in_draft, i).sum() for i in range(ttt_length)]
    )  # [K]


def step_denominators(counts: list[torch.Tensor], world_size: int = 1) -> torch.Tensor:
    """Per-TTT-step denominators ``max(N_i, 1) / world_size``, float32 ``[K]``: ``N_i`` sums ``counts`` (int64 ``[K]``
    per micro-batch) over the micro-batches and, with ``world_size > 1``, over ranks (one all-reduce,
    no host sync). Dividing by ``world_size`` undoes DDP's gradient averaging, so the step's gradient is that of
    ``sum_i w**i * S_i / N_i`` however the samples are split. Every rank must call it with the same ``K``.
    """
    total = torch.stack(list(counts)).sum(0).to(torch.float64)  # [K]
    if world_size > 1:
        import torch.distributed as dist

        dist.all_reduce(total)
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
    """Per-step 0-dim tensors stacked to ``{"loss", "ce_sum", "acc" (correct / max(count, 1)), "correct", "count"}``,
    each ``[K]``, no host sync.
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
    """One batch's TTT loss ``sum_i step_weight**i * S_i / D_i``, ``D_i`` = ``denom[i]`` or ``max(1, count_i)`` (the
    batch's own mean); :meth:`result` returns ``(loss, step_metrics)``.
    """

    def __init__(self, dev: torch.device, step_weight: float, denom: Optional[torch.Tensor]):
        self.total = torch.zeros((), dtype=torch.float32, device=dev)
        self.step_weight, self.denom = step_weight, denom
        self.losses, self.sums, self.corrects, self.counts = [], [], [], []

    def add(self, i: int, ce: torch.Tensor, valid: torch.Tensor, hit: torch.Tensor) -> None:
        """Step ``i``: per-position loss ``ce``, counted ``valid`` and top-1 ``hit`` (bool), same shape."""
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
    """The reference EAGLE-3 TTT loss over every position (:class:`StepSums` of :func:`eagle3.losses.token.token_loss`
    at the counted positions; accuracy: ``draft_to_target(argmax) == targets.argmax`` at ``t+1+i``).

    Args:
        drafter: :class:`eagle3.drafter.model.Eagle3Drafter`; ``step_hiddens``: its ``ttt_forward`` (K x [B, L, H]).
        targets: :func:`compute_targets` of the batch; ``loss_mask``: ``[B, L]``, 1 on assistant tokens.
        checkpoint: recompute each step's logits in backward.
        compact: logits only at the counted positions (same sums; syncs the host; None = on for CPU tensors).
        denom: float ``[K]`` (:func:`step_denominators`) or None (this batch's means).

    Returns:
        ``(loss scalar float32, metrics)``: detached ``[K]`` ``loss``, ``ce_sum``, ``acc``, ``correct``, ``count``.
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
        args = (drafter, hs, tgt, tgt_draft, loss, lk_eta)
        if checkpoint and torch.is_grad_enabled():
            ce, pred = _checkpoint(_step_terms, *args, use_reentrant=False)
        else:
            ce, pred = _step_terms(*args)
        acc.add(i, ce, valid, drafter.draft_to_target(pred) == tgt_am)
    return acc.result()
