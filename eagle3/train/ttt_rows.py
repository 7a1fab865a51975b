"""The TTT loss evaluated only at the positions that can count, chosen on the host with no device sync.

:func:`eagle3.train.ttt.ttt_loss` builds draft-vocab logits (``[B, L, 32000]`` per TTT step, over 80% of
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
the device. The sums are those of :func:`eagle3.train.ttt.ttt_loss` (same terms, another summation
order), so loss, gradients and metrics agree within float tolerance (tests/test_ttt_rows.py).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.utils.checkpoint import checkpoint as _checkpoint

from eagle3.train.ttt import TTTTargets, compute_targets, step_metrics


# ---------------------------------------------------------------------------------------------
# soft-label cross-entropy with a hand-written backward (few passes over [M, draft_V])
# ---------------------------------------------------------------------------------------------
def _soft_ce_fwd(logits: torch.Tensor, tgt_logp: torch.Tensor):
    """``ce = sum_j p_j (lse - x_j)`` with ``p = exp(tgt_logp)``, ``x`` = logits in float32; also ``lse``,
    ``sum_j p_j`` and the argmax. ``[M, V]`` -> ``[M]`` x 4."""
    x = logits.float()  # [M, V]
    lse = torch.logsumexp(x, dim=-1)  # [M]
    p = tgt_logp.exp()  # [M, V]
    ce = (p * (lse[:, None] - x)).sum(-1)  # [M]
    return ce, lse, p.sum(-1), x.argmax(-1)


def _soft_ce_bwd(logits: torch.Tensor, tgt_logp: torch.Tensor, lse: torch.Tensor, psum: torch.Tensor,
                 g: torch.Tensor) -> torch.Tensor:
    """``d ce / d x_j = softmax_j(x) * sum(p) - p_j``, times the incoming ``g`` ``[M]``; in ``logits.dtype``."""
    x = logits.float()  # [M, V]
    grad = torch.exp(x - lse[:, None]) * psum[:, None] - tgt_logp.exp()  # [M, V]
    return (grad * g[:, None]).to(logits.dtype)


_COMPILED: dict = {}


def _kernels(device: torch.device):
    """The two functions above, ``torch.compile``-d (dynamic M) on CUDA so each is one or two fused
    kernels; plain eager on CPU (and when compiling is unavailable)."""
    if device.type != "cuda":
        return _soft_ce_fwd, _soft_ce_bwd
    if "fns" not in _COMPILED:
        try:
            _COMPILED["fns"] = (torch.compile(_soft_ce_fwd, dynamic=True), torch.compile(_soft_ce_bwd, dynamic=True))
        except Exception:  # noqa: BLE001 - no inductor backend: eager is correct, only slower
            _COMPILED["fns"] = (_soft_ce_fwd, _soft_ce_bwd)
    return _COMPILED["fns"]


class _SoftCE(torch.autograd.Function):
    """Soft-label CE of draft logits against the verifier's draft-vocab log-probs, per row.

    Saves only the logits (bf16 under autocast) and the ``[M]`` statistics, instead of autograd's
    float32 copies, log-softmax and products (``[M, V]`` each, for every TTT step).
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, tgt_logp: torch.Tensor):
        fwd, _ = _kernels(logits.device)
        with torch.autocast(device_type=logits.device.type, enabled=False):  # float32 math as written
            ce, lse, psum, pred = fwd(logits, tgt_logp)
        ctx.save_for_backward(logits, tgt_logp, lse, psum)
        ctx.mark_non_differentiable(pred)
        return ce, pred

    @staticmethod
    def backward(ctx, g_ce: torch.Tensor, _g_pred):
        logits, tgt_logp, lse, psum = ctx.saved_tensors
        _, bwd = _kernels(logits.device)
        with torch.autocast(device_type=logits.device.type, enabled=False):
            return bwd(logits, tgt_logp, lse, psum, g_ce.float().contiguous()), None


def soft_ce(logits: torch.Tensor, tgt_logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row soft cross-entropy ``-(exp(tgt_logp) * log_softmax(logits)).sum(-1)`` float32 ``[M]`` and the
    logits' argmax int64 ``[M]``; gradient only to ``logits`` (the targets are constants).

    Args:
        logits: ``[M, V]`` draft logits (any float dtype).
        tgt_logp: ``[M, V]`` float32 verifier log-probs over the draft vocab.
    """
    return _SoftCE.apply(logits, tgt_logp.detach())


def _row_step_terms(drafter, hs: torch.Tensor, tgt_logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """CE ``[M]`` and draft argmax ``[M]`` of hidden rows ``hs`` ``[M, H]`` (``lm_head(norm(hs))``)."""
    return soft_ce(drafter.compute_logits(hs), tgt_logp)


@torch.no_grad()
def row_targets(last_hidden: torch.Tensor, loss_pos: torch.Tensor, lm_head_weight: torch.Tensor, d2t: torch.Tensor,
                t2d: torch.Tensor, norm_weight: Optional[torch.Tensor] = None, norm_eps: float = 1e-6,
                chunk: int = 1024) -> TTTTargets:
    """Verifier targets at the rows ``loss_pos - 1`` only (:func:`eagle3.train.ttt.compute_targets` on the gathered rows).

    Args:
        last_hidden: ``[B, L, Ht]`` verifier last hidden state.
        loss_pos: int64 ``[M]`` from :func:`eagle3.data.dataset.loss_positions` (same device).
        others: as :func:`eagle3.train.ttt.compute_targets`.

    Returns:
        :class:`eagle3.train.ttt.TTTTargets` with shapes ``[M, draft_V]`` float32, ``[M]`` bool, ``[M]`` int64.
    """
    B, L, Ht = last_hidden.shape
    rows = last_hidden.reshape(B * L, Ht)[loss_pos - 1]  # [M, Ht]
    t = compute_targets(rows[None], lm_head_weight, d2t, t2d, norm_weight=norm_weight, norm_eps=norm_eps, chunk=chunk)
    return TTTTargets(t.logp_draft[0], t.in_draft[0], t.argmax[0])  # [M, dV], [M], [M]


def ttt_row_counts(loss_pos: torch.Tensor, seq_len: int, in_draft: torch.Tensor, ttt_length: int) -> torch.Tensor:
    """Counted positions of each TTT step of one micro-batch (the rows version of ``eagle3.train.ttt.ttt_token_counts``).

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
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """EAGLE-3 TTT loss at the host-chosen rows; the same value and metrics as :func:`eagle3.train.ttt.ttt_loss`.

    ``S_i = sum_{counted rows} CE(p_{p-1}, q_{i, p-2-i})`` and ``loss = sum_i step_weight**i * S_i / D_i``,
    where ``D_i`` = ``denom[i]`` when given (``eagle3.train.ttt.step_denominators``: shared by every
    micro-batch and rank of an optimizer step), else ``max(1, #counted rows of step i)`` (the batch's
    own mean), exactly as :func:`eagle3.train.ttt.ttt_loss`.

    Args:
        drafter: :class:`eagle3.train.model.Eagle3Drafter` (``compute_logits``, ``draft_to_target``).
        step_hiddens: ``K`` tensors ``[B, L, H]`` from ``ttt_forward``.
        targets: :func:`row_targets` output for ``loss_pos`` (``[M, dV]``, ``[M]``, ``[M]``).
        loss_pos: int64 ``[M]`` from :func:`eagle3.data.dataset.loss_positions`.
        step_weight: weight base (``train.step_weight``).
        checkpoint: recompute each step's ``[M, draft_V]`` logits in backward instead of storing them.
        denom: optional float ``[K]`` normalisers (see above).

    Returns:
        ``(loss, metrics)`` as :func:`eagle3.train.ttt.ttt_loss`: scalar float32 loss and detached ``[K]``
        tensors ``loss`` (this batch's mean CE), ``ce_sum`` (``S_i``), ``acc``, ``correct`` int64,
        ``count`` int64; no host sync.
    """
    B, L, H = step_hiddens[0].shape
    dev = step_hiddens[0].device
    loss_pos = loss_pos.to(dev)
    p = loss_pos % L  # [M] predicted position within its sample
    total = torch.zeros((), dtype=torch.float32, device=dev)
    losses, sums, corrects, counts = [], [], [], []
    for i, h in enumerate(step_hiddens):
        ok = p >= 2 + i  # [M] the hidden row p-2-i exists
        valid = ok & targets.in_draft  # [M]
        rows = (loss_pos - 2 - i).clamp(min=0)  # [M] (rows of invalid entries are never counted)
        hs = h.reshape(B * L, H)[rows]  # [M, H]
        if checkpoint and torch.is_grad_enabled():
            ce, pred = _checkpoint(_row_step_terms, drafter, hs, targets.logp_draft, use_reentrant=False,
                                   preserve_rng_state=False)  # no random numbers; saving the RNG state syncs
        else:
            ce, pred = _row_step_terms(drafter, hs, targets.logp_draft)  # [M], [M]
        cnt = valid.sum()
        ce_sum = (ce * valid).sum()  # S_i
        step_loss = ce_sum / cnt.clamp(min=1)
        total = total + (step_weight**i) * (step_loss if denom is None else ce_sum / denom[i])
        correct = ((drafter.draft_to_target(pred) == targets.argmax) & valid).sum()
        losses.append(step_loss.detach())
        sums.append(ce_sum.detach())
        corrects.append(correct)
        counts.append(cnt)
    return total, step_metrics(losses, sums, corrects, counts)
