"""The TTT loss at the host-chosen loss rows only: the sums of :func:`eagle3.losses.ttt.ttt_loss` (same terms, another
order), without the draft-vocab logits of prompt and padding positions.

For each loss position ``p >= 2`` of sample ``b`` (DESIGN.md "TTT indexing"): the verifier target row is ``(b, p-1)``
for every TTT step (targets computed once, at ``M`` rows), and step ``i`` reads the drafter hidden row
``(b, p-2-i)``, counted iff ``p-2-i >= 0`` and the target's argmax is in the draft vocab. ``loss_pos`` (``b * L + p``,
int64 ``[M]``) is listed on the host by :func:`eagle3.data.dataset.loss_positions` in the loader workers.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.utils.checkpoint import checkpoint as _checkpoint

from eagle3.losses.token import LK_ETA, row_loss
from eagle3.losses.ttt import StepSums, TTTTargets, compute_targets, draft_index


def _row_step_terms(
    drafter,
    hs: torch.Tensor,
    tgt_logp: torch.Tensor,
    tgt_draft: Optional[torch.Tensor] = None,
    loss: str = "soft_ce",
    lk_eta: float = LK_ETA,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss ``[M]`` and draft argmax ``[M]`` of step outputs ``hs`` ``[M, H]`` (:meth:`compute_logits`)."""
    return row_loss(drafter.compute_logits(hs), tgt_logp, tgt_draft, loss, lk_eta)


@torch.no_grad()
def row_targets(
    last_hidden: torch.Tensor,
    loss_pos: torch.Tensor,
    lm_head_weight: torch.Tensor,
    d2t: torch.Tensor,
    t2d: torch.Tensor,
    norm_weight: Optional[torch.Tensor] = None,
    norm_eps: float = 1e-6,
    chunk: int = 1024,
) -> TTTTargets:
    """:func:`eagle3.losses.ttt.compute_targets` at the rows ``loss_pos - 1`` of ``last_hidden`` ``[B, L, Ht]``
    (``loss_pos`` int64 ``[M]``, same device): ``TTTTargets`` of ``[M, dV]`` float32, ``[M]`` bool, ``[M]`` int64.
    """
    B, L, Ht = last_hidden.shape
    rows = last_hidden.reshape(B * L, Ht)[loss_pos - 1]  # [M, Ht]
    t = compute_targets(rows[None], lm_head_weight, d2t, t2d, norm_weight, norm_eps, chunk)
    return TTTTargets(t.logp_draft[0], t.in_draft[0], t.argmax[0])  # [M, dV], [M], [M]


def ttt_row_counts(
    loss_pos: torch.Tensor, seq_len: int, in_draft: torch.Tensor, ttt_length: int
) -> torch.Tensor:
    """Counted rows of each TTT step (row ``(b, p)`` counts for step ``i`` iff ``p >= 2 + i`` and ``in_draft`` ``[M]``):
    int64 ``[K]`` on ``in_draft``'s device, no host sync. ``seq_len``: the batch's padded ``L``.
    """
    p = loss_pos.to(in_draft.device) % seq_len  # [M]
    return torch.stack([((p >= 2 + i) & in_draft).sum() for i in range(ttt_length)])  # [K]


def ttt_loss_rows(
    drafter,
    step_hiddens: list[torch.Tensor],
    targets: TTTTargets,
    loss_pos: torch.Tensor,
    step_weight: float = 0.8,
    checkpoint: bool = False,
    denom: Optional[torch.Tensor] = None,
    loss: str = "soft_ce",
    lk_eta: float = LK_ETA,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The EAGLE-3 TTT loss at the rows ``loss_pos`` (int64 ``[M]``): ``S_i = sum_{counted} loss(p_{p-1}, q_{i, p-2-i})``,
    ``loss = sum_i step_weight**i * S_i / D_i`` (:class:`eagle3.losses.ttt.StepSums`). ``step_hiddens``: K x
    ``[B, L, H]``; ``targets``: :func:`row_targets`; ``checkpoint``: recompute each step's ``[M, dV]`` logits in
    backward. Returns ``(loss, metrics)`` as :func:`eagle3.losses.ttt.ttt_loss`, no host sync.
    """
    B, L, H = step_hiddens[0].shape
    dev = step_hiddens[0].device
    loss_pos = loss_pos.to(dev)
    p = loss_pos % L  # [M] predicted position within its sample
    acc = StepSums(dev, step_weight, denom)
    tgt_draft = draft_index(targets.argmax, drafter.d2t) if loss == "hard_ce" else None  # [M]
    for i, h in enumerate(step_hiddens):
        ok = p >= 2 + i  # [M] the hidden row p-2-i exists
        valid = ok & targets.in_draft  # [M]
        rows = (loss_pos - 2 - i).clamp(min=0)  # [M] (rows of invalid entries are never counted)
        hs = h.reshape(B * L, H)[rows]  # [M, H]
        args = (drafter, hs, targets.logp_draft, tgt_draft, loss, lk_eta)
        if checkpoint and torch.is_grad_enabled():  # no random numbers: saving the RNG state syncs
            ce, pred = _checkpoint(
                _row_step_terms, *args, use_reentrant=False, preserve_rng_state=False
            )
        else:
            ce, pred = _row_step_terms(*args)  # [M], [M]
        acc.add(i, ce, valid, drafter.draft_to_target(pred) == targets.argmax)
    return acc.result()
