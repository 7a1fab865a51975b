"""The TTT loss evaluated only at the positions that can count, chosen on the host with no device sync.

:func:`eagle3.losses.ttt.ttt_loss` builds draft-vocab logits (``[B, L, 32000]`` per TTT step, over 80% of
a small drafter's FLOPs) and verifier targets at every position, prompt and padding included, and
then masks most of them away. Which positions can count is known on the host from the loss mask
alone (DESIGN.md "TTT indexing"): step ``i`` at position ``t`` predicts ``x_{t+2+i}`` and counts iff
``loss_mask[t+2+i] == 1``, ``t >= 0`` and the verifier argmax at ``t+1+i`` is in the draft vocab.
Writing ``p = t + 2 + i`` for the predicted position, the counted pairs are, for every loss
position ``p >= 2`` of sample ``b``:

- the verifier target row ``(b, p - 1)``, the SAME for every TTT step (``p_{t+1+i} = p_{p-1}``), so
  targets are computed once, at ``M`` rows instead of ``B * L``;
- the drafter hidden row ``(b, p - 2 - i)`` of step ``i``, counted iff ``p - 2 - i >= 0`` and the
  target's argmax is in the draft vocab.

:func:`eagle3.data.dataset.loss_positions` lists ``b * L + p`` on the host (the collate function does it in the data
loader workers); :func:`row_targets` and :func:`ttt_loss_rows` gather with that fixed-size index on
the device. The sums are those of :func:`eagle3.losses.ttt.ttt_loss` (same terms, another summation
order), so loss, gradients and metrics agree within float tolerance (tests/test_ttt_rows.py).
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
    """Verifier targets at the rows ``loss_pos - 1`` only (:func:`eagle3.losses.ttt.compute_targets` on the gathered rows).

    Args:
        last_hidden: ``[B, L, Ht]`` verifier last hidden state.
        loss_pos: int64 ``[M]`` from :func:`eagle3.data.dataset.loss_positions` (same device).
        others: as :func:`eagle3.losses.ttt.compute_targets`.

    Returns:
        :class:`eagle3.losses.ttt.TTTTargets` with shapes ``[M, draft_V]`` float32, ``[M]`` bool, ``[M]`` int64.
    """
    B, L, Ht = last_hidden.shape
    rows = last_hidden.reshape(B * L, Ht)[loss_pos - 1]  # [M, Ht]
    t = compute_targets(
        rows[None],
        lm_head_weight,
        d2t,
        t2d,
        norm_weight=norm_weight,
        norm_eps=norm_eps,
        chunk=chunk,
    )
    return TTTTargets(t.logp_draft[0], t.in_draft[0], t.argmax[0])  # [M, dV], [M], [M]


def ttt_row_counts(
    loss_pos: torch.Tensor, seq_len: int, in_draft: torch.Tensor, ttt_length: int
) -> torch.Tensor:
    """Counted positions of each TTT step of one micro-batch (the rows version of ``eagle3.losses.ttt.ttt_token_counts``).

    Step ``i`` counts the loss row ``(b, p)`` iff ``p >= 2 + i`` and the target at ``p - 1`` is in the draft vocab.

    Args:
        loss_pos: int64 ``[M]`` (:func:`eagle3.data.dataset.loss_positions`), seq_len: the padded length ``L`` of the batch,
        in_draft: bool ``[M]`` (:func:`row_targets`), ttt_length: ``K``.

    Returns:
        int64 ``[K]`` on ``in_draft``'s device (no host sync).
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
    """EAGLE-3 TTT loss at the host-chosen rows; the same value and metrics as :func:`eagle3.losses.ttt.ttt_loss`.

    ``S_i = sum_{counted rows} CE(p_{p-1}, q_{i, p-2-i})`` and ``loss = sum_i step_weight**i * S_i / D_i``
    (:class:`eagle3.losses.ttt.StepSums`: ``D_i`` = ``denom[i]`` when given, else the batch's own count).

    Args:
        drafter: :class:`eagle3.drafter.model.Eagle3Drafter` (``compute_logits``, ``draft_to_target``).
        step_hiddens: ``K`` tensors ``[B, L, H]`` from ``ttt_forward``.
        targets: :func:`row_targets` output for ``loss_pos`` (``[M, dV]``, ``[M]``, ``[M]``).
        loss_pos: int64 ``[M]`` from :func:`eagle3.data.dataset.loss_positions`.
        step_weight: weight base (``train.step_weight``).
        checkpoint: recompute each step's ``[M, draft_V]`` logits in backward instead of storing them.
        denom: optional float ``[K]`` normalisers (see above).
        loss / lk_eta: the per-token loss (``train.loss``, :func:`eagle3.losses.token.token_loss`); ``CE`` above is it.

    Returns:
        ``(loss, metrics)`` as :func:`eagle3.losses.ttt.ttt_loss`; no host sync.
    """
    B, L, H = step_hiddens[0].shape
    dev = step_hiddens[0].device
    loss_pos = loss_pos.to(dev)
    p = loss_pos % L  # [M] predicted position within its sample
    acc = StepSums(dev, step_weight, denom)
    tgt_draft = (
        draft_index(targets.argmax, drafter.d2t) if loss == "hard_ce" else None
    )  # [M], the same every step
    for i, h in enumerate(step_hiddens):
        ok = p >= 2 + i  # [M] the hidden row p-2-i exists
        valid = ok & targets.in_draft  # [M]
        rows = (loss_pos - 2 - i).clamp(min=0)  # [M] (rows of invalid entries are never counted)
        hs = h.reshape(B * L, H)[rows]  # [M, H]
        if checkpoint and torch.is_grad_enabled():
            ce, pred = _checkpoint(
                _row_step_terms,
                drafter,
                hs,
                targets.logp_draft,
                tgt_draft,
                loss,
                lk_eta,
                use_reentrant=False,
                preserve_rng_state=False,
            )  # no random numbers; saving the RNG state syncs
        else:
            ce, pred = _row_step_terms(
                drafter, hs, targets.logp_draft, tgt_draft, loss, lk_eta
            )  # [M], [M]
        acc.add(i, ce, valid, drafter.draft_to_target(pred) == targets.argmax)
    return acc.result()
