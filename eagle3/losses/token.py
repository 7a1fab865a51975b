"""The per-token losses of ``train.loss`` by name (:data:`LOSSES`): each as a reference form (plain autograd,
:func:`token_loss`) and the fused row kernel training uses (hand-written backward, :func:`row_loss`); the kernels
are tested against the references.

With ``p = exp(tgt_logp)`` (verifier, draft vocab, renormalised), ``q = softmax(logits)`` and the overlap
``alpha = sum_v min(p_v, q_v)`` (speculative sampling's acceptance probability):
``soft_ce`` ``-sum_v p_v log q_v`` (EAGLE-3, default); ``hard_ce`` ``-log q_y``, ``y`` the verifier argmax as a
draft id; ``tv`` ``1 - alpha``; ``lk_hybrid`` ``lam * KL(p||q) + (1 - lam)(1 - alpha)``, ``lam =
exp(-lk_eta * sg(alpha))`` per token (arXiv 2602.23881; per token so that the step normalisation holds).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

LK_ETA = 3.0  # default eta of lk_hybrid (arXiv 2602.23881's best hybrid setting)


# ---- reference forms: (logq [..., V], p [..., V], tgt_logp [..., V], y [...] | None, eta) -> loss [...] ----
def _soft_ce_ref(logq, p, tgt_logp, y, eta):
    return -(p * logq).sum(-1)


def _hard_ce_ref(logq, p, tgt_logp, y, eta):
    return -logq.gather(-1, y[..., None]).squeeze(-1)


def _tv_ref(logq, p, tgt_logp, y, eta):
    alpha = torch.minimum(p, logq.exp()).sum(-1)  # [...]
    return 1.0 - alpha


def _lk_hybrid_ref(logq, p, tgt_logp, y, eta):
    alpha = torch.minimum(p, logq.exp()).sum(-1)  # [...]
    kl = (p * (tgt_logp - logq)).sum(-1)  # [...]
    lam = torch.exp(-eta * alpha.detach())
    return lam * kl + (1.0 - lam) * (1.0 - alpha)


# ---- fused row kernels: float32 math on [M, V] logits, [M] statistics saved for the backward ----
def _soft_ce_fwd(logits: torch.Tensor, tgt_logp: torch.Tensor):
    """``ce = sum_j p_j (lse - x_j)``, ``lse``, ``sum_j p_j``, argmax: ``[M, V]`` -> ``[M]`` x 4 (float32)."""
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
    """``tv`` / ``lk_hybrid`` (``lk``) loss, ``lse``, ``psum``, ``lam`` (zeros for ``tv``), argmax, all ``[M]``."""
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
    """Gradient of :func:`_overlap_fwd` in ``x`` times ``g`` ``[M]``: ``d(1 - alpha)/dx_j = q_j (a - 1[q_j < p_j])``,
    ``a = sum_v q_v 1[q_v < p_v]``; ``d KL / dx_j = q_j sum(p) - p_j``.
    """
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
    """``fn`` ``torch.compile``-d (dynamic M) on CUDA, eager on CPU; a compile failure falls back to eager for good
    (the functions are pure).
    """
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


# ---- the registry: forward(logits, tgt_logp, y, eta, device) -> (loss [M], argmax [M], saved tensors);
# backward(saved, g [M], eta, device) -> d loss / d logits [M, V] ----
def _soft_ce_rows(logits, tgt_logp, y, eta, dev):
    loss, lse, psum, pred = _kernel(_soft_ce_fwd, dev)(logits, tgt_logp)
    return loss, pred, (logits, tgt_logp, lse, psum)


def _hard_ce_rows(logits, tgt_logp, y, eta, dev):
    loss, lse, pred = _kernel(_hard_ce_fwd, dev)(logits, y)
    return loss, pred, (logits, y, lse)


def _overlap_rows(lk: bool):
    def rows(logits, tgt_logp, y, eta, dev):
        loss, lse, psum, lam, pred = _kernel(_overlap_fwd, dev)(logits, tgt_logp, lk, eta)
        return loss, pred, (logits, tgt_logp, lse, psum, lam)

    return rows


def _overlap_rows_bwd(lk: bool):
    return lambda saved, g, eta, dev: _kernel(_overlap_bwd, dev)(*saved, g, lk)


@dataclass(frozen=True)
class TokenLoss:
    """One ``train.loss``: its ``reference`` form and its fused row kernel (``rows_forward``, ``rows_backward``);
    ``needs_argmax``: it takes the draft id of the verifier's argmax (``tgt_draft``)."""

    reference: Callable
    rows_forward: Callable
    rows_backward: Callable
    needs_argmax: bool = False


LOSSES: dict[str, TokenLoss] = {
    "soft_ce": TokenLoss(
        _soft_ce_ref,
        _soft_ce_rows,
        lambda saved, g, eta, dev: _kernel(_soft_ce_bwd, dev)(*saved, g),
    ),
    "hard_ce": TokenLoss(
        _hard_ce_ref,
        _hard_ce_rows,
        lambda saved, g, eta, dev: _kernel(_hard_ce_bwd, dev)(*saved, g),
        needs_argmax=True,
    ),
    "tv": TokenLoss(_tv_ref, _overlap_rows(False), _overlap_rows_bwd(False)),
    "lk_hybrid": TokenLoss(_lk_hybrid_ref, _overlap_rows(True), _overlap_rows_bwd(True)),
}


def _spec(loss: str, tgt_draft: Optional[torch.Tensor]) -> TokenLoss:
    spec = LOSSES.get(loss)
    if spec is not None and spec.needs_argmax and tgt_draft is None:
        raise ValueError("hard_ce needs the draft id of the verifier's argmax (tgt_draft)")
    if spec is None:
        raise ValueError(f"unknown loss {loss!r} (expected one of {', '.join(LOSSES)})")
    return spec


def token_loss(
    logits: torch.Tensor,
    tgt_logp: torch.Tensor,
    tgt_draft: Optional[torch.Tensor] = None,
    loss: str = "soft_ce",
    lk_eta: float = LK_ETA,
) -> torch.Tensor:
    """The per-token loss ``loss`` (a :data:`LOSSES` name) in its reference form, float32 ``[...]``, from ``logits``
    and ``tgt_logp`` ``[..., dV]``; ``tgt_draft`` int64 ``[...]`` only for ``hard_ce``.

    Raises:
        ValueError: unknown ``loss``, or ``hard_ce`` without ``tgt_draft``.
    """
    spec = _spec(loss, tgt_draft)
    x = logits.float()
    logq = torch.log_softmax(x, dim=-1)  # [..., V]
    p = tgt_logp.exp()  # [..., V]
    return spec.reference(logq, p, tgt_logp, tgt_draft, lk_eta)


class _RowLoss(torch.autograd.Function):
    """The fused kernel of a :data:`LOSSES` entry: saves the logits, the targets and ``[M]`` statistics instead of
    autograd's float32 ``[M, V]`` intermediates.
    """

    @staticmethod
    def forward(ctx, logits, tgt_logp, y, kind: str, eta: float):
        spec = LOSSES[kind]
        ctx.spec, ctx.eta = spec, eta
        with torch.autocast(device_type=logits.device.type, enabled=False):
            loss, pred, saved = spec.rows_forward(logits, tgt_logp, y, eta, logits.device)
        ctx.save_for_backward(*saved)
        ctx.mark_non_differentiable(pred)
        return loss, pred

    @staticmethod
    def backward(ctx, g_loss: torch.Tensor, _g_pred):
        saved = ctx.saved_tensors
        dev = saved[0].device
        g = g_loss.float().contiguous()
        with torch.autocast(device_type=dev.type, enabled=False):
            grad = ctx.spec.rows_backward(saved, g, ctx.eta, dev)
        return grad, None, None, None, None


def row_loss(
    logits: torch.Tensor,
    tgt_logp: torch.Tensor,
    tgt_draft: Optional[torch.Tensor] = None,
    loss: str = "soft_ce",
    lk_eta: float = LK_ETA,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row loss float32 ``[M]`` (the values of :func:`token_loss`) and the argmax int64 ``[M]`` of ``logits``
    ``[M, V]``; gradient to ``logits`` only. Raises ValueError as :func:`token_loss`.
    """
    _spec(loss, tgt_draft)
    return _RowLoss.apply(logits, tgt_logp.detach(), tgt_draft, loss, float(lk_eta))
