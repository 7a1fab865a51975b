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

import logging
from typing import Optional

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint as _checkpoint

from eagle3.train.ttt import LK_ETA, TTTTargets, compute_targets, draft_index, step_metrics

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# per-row losses with hand-written backwards (few passes over [M, draft_V]; eagle3.train.ttt.token_loss
# is the autograd reference they are tested against)
# ---------------------------------------------------------------------------------------------
def _soft_ce_fwd(logits: torch.Tensor, tgt_logp: torch.Tensor):
    """``ce = sum_j p_j (lse - x_j)`` with ``p = exp(tgt_logp)``, ``x`` = logits in float32; also ``lse``,
    ``sum_j p_j`` and the argmax. ``[M, V]`` -> ``[M]`` x 4."""
    x = logits.float()  # [M, V]
    lse = torch.logsumexp(x, dim=-1)  # [M]
    p = tgt_logp.exp()  # [M, V]
    ce = (p * (lse[:, None] - x)).sum(-1)  # [M]
    return ce, lse, p.sum(-1), x.argmax(-1)


def _soft_ce_bwd(
    logits: torch.Tensor,
    tgt_logp: torch.Tensor,
    lse: torch.Tensor,
    psum: torch.Tensor,
    g: torch.Tensor,
) -> torch.Tensor:
    """``d ce / d x_j = softmax_j(x) * sum(p) - p_j``, times the incoming ``g`` ``[M]``; in ``logits.dtype``."""
    x = logits.float()  # [M, V]
    grad = torch.exp(x - lse[:, None]) * psum[:, None] - tgt_logp.exp()  # [M, V]
    return (grad * g[:, None]).to(logits.dtype)


def _hard_ce_fwd(logits: torch.Tensor, y: torch.Tensor):
    """``ce = lse - x_y`` ``[M]``, ``lse`` ``[M]``, argmax ``[M]``; ``y`` int64 ``[M]`` draft ids."""
    x = logits.float()  # [M, V]
    lse = torch.logsumexp(x, dim=-1)  # [M]
    return lse - x.gather(1, y[:, None]).squeeze(1), lse, x.argmax(-1)


def _hard_ce_bwd(
    logits: torch.Tensor, y: torch.Tensor, lse: torch.Tensor, g: torch.Tensor
) -> torch.Tensor:
    """``d ce / d x_j = softmax_j(x) - [j == y]``, times ``g`` ``[M]``."""
    q = torch.exp(logits.float() - lse[:, None])  # [M, V]
    grad = q - F.one_hot(y, q.shape[1]).to(q.dtype)  # [M, V]
    return (grad * g[:, None]).to(logits.dtype)


def _overlap_fwd(logits: torch.Tensor, tgt_logp: torch.Tensor, lk: bool, eta: float):
    """``tv``: ``1 - alpha``; ``lk``: ``lam * KL(p||q) + (1 - lam)(1 - alpha)``, ``lam = exp(-eta alpha)``
    (:func:`eagle3.train.ttt.token_loss`). Returns the loss, ``lse``, ``psum``, ``lam`` (zeros for ``tv``), argmax, all ``[M]``."""
    x = logits.float()  # [M, V]
    lse = torch.logsumexp(x, dim=-1)  # [M]
    logq = x - lse[:, None]  # [M, V]
    p = tgt_logp.exp()  # [M, V]
    alpha = torch.minimum(p, logq.exp()).sum(-1)  # [M]
    psum = p.sum(-1)  # [M]
    if not lk:
        return 1.0 - alpha, lse, psum, torch.zeros_like(alpha), x.argmax(-1)
    kl = (p * (tgt_logp - logq)).sum(-1)  # [M]
    lam = torch.exp(-eta * alpha)  # [M] (a constant for the backward: stop-gradient)
    return lam * kl + (1.0 - lam) * (1.0 - alpha), lse, psum, lam, x.argmax(-1)


def _overlap_bwd(
    logits: torch.Tensor,
    tgt_logp: torch.Tensor,
    lse: torch.Tensor,
    psum: torch.Tensor,
    lam: torch.Tensor,
    g: torch.Tensor,
    lk: bool,
) -> torch.Tensor:
    """Gradient of :func:`_overlap_fwd`'s loss in ``x``, times ``g`` ``[M]``.

    ``d(1 - alpha)/dx_j = q_j (a - 1[q_j < p_j])`` with ``a = sum_v q_v 1[q_v < p_v]`` (``d alpha / d q_v =
    1[q_v < p_v]``, through the softmax Jacobian); ``d KL / dx_j = q_j sum(p) - p_j``."""
    q = torch.exp(logits.float() - lse[:, None])  # [M, V]
    p = tgt_logp.exp()  # [M, V]
    below = (q < p).to(q.dtype)  # [M, V]
    a = (q * below).sum(-1, keepdim=True)  # [M, 1]
    grad = q * (a - below)  # [M, V] d TV / dx
    if lk:
        grad = lam[:, None] * (q * psum[:, None] - p) + (1.0 - lam[:, None]) * grad
    return (grad * g[:, None]).to(logits.dtype)


_COMPILED: dict = {}


def _kernel(fn, device: torch.device):
    """``fn`` ``torch.compile``-d (dynamic M) on CUDA so it becomes one or two fused kernels; plain eager on
    CPU. A compile failure (no inductor backend, a dynamo error at the first call) falls back to eager once
    and for good: the functions are pure, so the eager result is the same."""
    if device.type != "cuda":
        return fn
    if fn not in _COMPILED:
        try:
            compiled = torch.compile(fn, dynamic=True)
        except Exception:  # noqa: BLE001 - no inductor backend: eager is correct, only slower
            compiled = fn

        def call(*args, _c=compiled, _fn=fn):
            if _COMPILED.get(("failed", _fn)):
                return _fn(*args)
            try:
                return _c(*args)
            except Exception as e:  # noqa: BLE001
                log.warning(
                    "torch.compile of %s failed (%s); using eager",
                    _fn.__name__,
                    str(e).splitlines()[0][:200],
                )
                _COMPILED[("failed", _fn)] = True
                return _fn(*args)

        _COMPILED[fn] = call
    return _COMPILED[fn]


class _RowLoss(torch.autograd.Function):
    """A per-row loss of draft logits against the verifier targets (``kind`` in :data:`eagle3.train.ttt.LOSSES`).

    Saves only the logits (bf16 under autocast), the targets already alive and ``[M]`` statistics, instead
    of autograd's float32 copies, softmaxes and products (``[M, V]`` each, for every TTT step).
    """

    @staticmethod
    def forward(
        ctx,
        logits: torch.Tensor,
        tgt_logp: torch.Tensor,
        y: Optional[torch.Tensor],
        kind: str,
        eta: float,
    ):
        dev = logits.device
        ctx.kind = kind
        with torch.autocast(device_type=dev.type, enabled=False):  # float32 math as written
            if kind == "soft_ce":
                loss, lse, psum, pred = _kernel(_soft_ce_fwd, dev)(logits, tgt_logp)
                ctx.save_for_backward(logits, tgt_logp, lse, psum)
            elif kind == "hard_ce":
                loss, lse, pred = _kernel(_hard_ce_fwd, dev)(logits, y)
                ctx.save_for_backward(logits, y, lse)
            elif kind in ("tv", "lk_hybrid"):
                loss, lse, psum, lam, pred = _kernel(_overlap_fwd, dev)(
                    logits, tgt_logp, kind == "lk_hybrid", eta
                )
                ctx.save_for_backward(logits, tgt_logp, lse, psum, lam)
            else:
                raise ValueError(f"unknown loss {kind!r}")
        ctx.mark_non_differentiable(pred)
        return loss, pred

    @staticmethod
    def backward(ctx, g_loss: torch.Tensor, _g_pred):
        saved = ctx.saved_tensors
        dev = saved[0].device
        g = g_loss.float().contiguous()
        with torch.autocast(device_type=dev.type, enabled=False):
            if ctx.kind == "soft_ce":
                grad = _kernel(_soft_ce_bwd, dev)(*saved, g)
            elif ctx.kind == "hard_ce":
                grad = _kernel(_hard_ce_bwd, dev)(*saved, g)
            else:
                grad = _kernel(_overlap_bwd, dev)(*saved, g, ctx.kind == "lk_hybrid")
        return grad, None, None, None, None


def row_loss(
    logits: torch.Tensor,
    tgt_logp: torch.Tensor,
    tgt_draft: Optional[torch.Tensor] = None,
    loss: str = "soft_ce",
    lk_eta: float = LK_ETA,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row loss float32 ``[M]`` (:func:`eagle3.train.ttt.token_loss`, same values) and the logits' argmax int64
    ``[M]``; gradient only to ``logits`` (the targets are constants), by a hand-written backward.

    Args:
        logits: ``[M, V]`` draft logits (any float dtype).
        tgt_logp: ``[M, V]`` float32 verifier log-probs over the draft vocab.
        tgt_draft: int64 ``[M]`` draft id of the verifier argmax (``hard_ce``; :func:`eagle3.train.ttt.draft_index`).
        loss / lk_eta: see :func:`eagle3.train.ttt.token_loss`.

    Raises:
        ValueError: unknown ``loss``, or ``hard_ce`` without ``tgt_draft``.
    """
    if loss == "hard_ce" and tgt_draft is None:
        raise ValueError("hard_ce needs the draft id of the verifier's argmax (tgt_draft)")
    return _RowLoss.apply(logits, tgt_logp.detach(), tgt_draft, loss, float(lk_eta))


def soft_ce(logits: torch.Tensor, tgt_logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row soft cross-entropy ``-(exp(tgt_logp) * log_softmax(logits)).sum(-1)`` float32 ``[M]`` and the
    logits' argmax int64 ``[M]``; gradient only to ``logits`` (the targets are constants).

    Args:
        logits: ``[M, V]`` draft logits (any float dtype).
        tgt_logp: ``[M, V]`` float32 verifier log-probs over the draft vocab.
    """
    return row_loss(logits, tgt_logp)


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
    loss: str = "soft_ce",
    lk_eta: float = LK_ETA,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """EAGLE-3 TTT loss at the host-chosen rows; the same value and metrics as :func:`eagle3.train.ttt.ttt_loss`.

    ``S_i = sum_{counted rows} CE(p_{p-1}, q_{i, p-2-i})`` and ``loss = sum_i step_weight**i * S_i / D_i``,
    where ``D_i`` = ``denom[i]`` when given (``eagle3.train.ttt.step_denominators``: shared by every
    micro-batch and rank of an optimizer step), else ``max(1, #counted rows of step i)`` (the batch's
    own mean), exactly as :func:`eagle3.train.ttt.ttt_loss`.

    Args:
        drafter: :class:`eagle3.drafter.model.Eagle3Drafter` (``compute_logits``, ``draft_to_target``).
        step_hiddens: ``K`` tensors ``[B, L, H]`` from ``ttt_forward``.
        targets: :func:`row_targets` output for ``loss_pos`` (``[M, dV]``, ``[M]``, ``[M]``).
        loss_pos: int64 ``[M]`` from :func:`eagle3.data.dataset.loss_positions`.
        step_weight: weight base (``train.step_weight``).
        checkpoint: recompute each step's ``[M, draft_V]`` logits in backward instead of storing them.
        denom: optional float ``[K]`` normalisers (see above).
        loss / lk_eta: the per-token loss (``train.loss``, :func:`eagle3.train.ttt.token_loss`); ``CE`` above is it.

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
