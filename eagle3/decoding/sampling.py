"""Decoding at temperature > 0: processed distributions, plain sampling and speculative rejection
sampling (arXiv 2211.17192, 2302.01318), or block verification (arXiv 2403.10444).

``p`` (verifier) and ``q`` (drafter, placed at verifier ids ``draft + d2t[draft]``) are the
temperature / top-p processed distributions. ``standard``: draft ``x`` at position ``j`` is accepted
with probability ``min(1, p_j(x) / q_j(x))``; at the first rejection a token is sampled from
``norm(max(0, p_j - q_j))``, after ``k`` acceptances a bonus from ``p_k``. ``block``: the chain is
judged as a whole (:func:`block_accept`), which accepts at least as many drafts in expectation. Either
way the output is distributed as plain sampling from ``p``. The method names are vLLM's
``rejection_sample_method``. Draws use the sampler's seeded generator per device.
"""

from __future__ import annotations

from typing import Literal, Optional

import torch

#: the rejection rules, by vLLM's ``speculative_config.rejection_sample_method`` names
Method = Literal["standard", "block"]

#: the seed of every sampler 05 makes (each set starts from it, so a set's tokens do not depend on the sets before)
SEED = 0


def processed_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """float32 probabilities ``[..., V]`` of ``logits`` at ``temperature`` (> 0) with top-p: the most
    probable tokens until the mass before a token reaches ``top_p`` (top-1 always), renormalised.
    """
    p = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p >= 1.0:
        return p
    sp, idx = p.sort(dim=-1, descending=True)
    sp = sp.masked_fill(sp.cumsum(-1) - sp >= top_p, 0.0)
    p = torch.zeros_like(p).scatter_(-1, idx, sp)
    return p / p.sum(-1, keepdim=True)


def accept(p_x: torch.Tensor, q_x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The acceptance rule: draft ``x`` stays when ``u < min(1, p(x) / q(x))`` for ``u ~ U[0, 1)``, written
    ``u * q(x) < p(x)`` (no division; ``q(x) > 0`` for a drafted ``x``). Same-shape float tensors -> bool."""
    return u * q_x < p_x


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Unnormalised weights of the token sampled at the first rejection: ``max(0, p - q)`` (``[B, V]``)."""
    return (p - q).clamp_min(0.0)


def block_accept(
    p_x: torch.Tensor, q_x: torch.Tensor, P: torch.Tensor, Q: torch.Tensor, u: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block verification of a chain of ``k`` drafts (Sun et al. 2024, arXiv 2403.10444, Algorithm 2).

    With ``w_0 = 1`` and ``w_i = min(1, w_{i-1} p_i(x_i) / q_i(x_i))``, position ``i < k`` passes when
    ``u_i <= r_i / (r_i + 1 - w_i)``, ``r_i = sum_x max(0, w_i p_{i+1}(x) - q_{i+1}(x))``, position ``k`` when
    ``u_k <= w_k``; the chain keeps the drafts up to the LAST position that passes (0 if none).

    Args:
        p_x, q_x: float ``[B, k]`` probabilities of each draft under ``p`` and ``q`` (``q_x > 0``).
        P, Q: float ``[B, k+1, V]`` processed distributions (``Q``'s row ``k`` is 0). u: ``[B, k]`` in [0, 1).

    Returns:
        ``(accepted [B] int64, w [B] float)``: ``w_accepted``, the weight of ``p`` in the residual
        ``max(0, w p - q)`` from which the next token is drawn (at ``accepted = k``, ``q = 0``: the bonus from ``p``).
    """
    B, k = p_x.shape
    w = [torch.ones(B, dtype=P.dtype, device=P.device)]
    for i in range(k):
        w.append(torch.clamp(w[-1] * p_x[:, i] / q_x[:, i], max=1.0))
    W = torch.stack(w, 1)  # [B, k+1]
    r = residual(W[:, 1:k, None] * P[:, 1:k], Q[:, 1:k]).sum(-1)  # [B, k-1]
    den = r + 1.0 - W[:, 1:k]
    h = torch.cat([torch.where(den > 0, r / den.clamp_min(1e-30), 1.0), W[:, k:]], 1)  # [B, k]
    pos = torch.arange(1, k + 1, device=P.device)
    a = torch.where(u <= h, pos, 0).amax(1)  # [B]
    return a, W.gather(1, a[:, None])[:, 0]


class Sampler:
    """Sampling at ``temperature`` > 0 and ``top_p`` in (0, 1] (the ``benchmark`` config's bounds) with a
    seeded generator per device; ``method`` the rejection rule of :meth:`verify`."""

    def __init__(
        self, temperature: float, top_p: float = 1.0, seed: int = SEED, method: Method = "standard"
    ):
        self.temperature, self.top_p, self.seed = float(temperature), float(top_p), int(seed)
        if method not in ("standard", "block"):
            raise ValueError(f"rejection method {method!r}: 'standard' or 'block'")
        self.method = method
        self._gens: dict[str, torch.Generator] = {}

    def generator(self, device: torch.device) -> torch.Generator:
        """The seeded generator of ``device`` (made on first use)."""
        key = str(torch.device(device))
        if key not in self._gens:
            self._gens[key] = torch.Generator(device=device).manual_seed(self.seed)
        return self._gens[key]

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """:func:`processed_probs` at this sampler's settings: float32 ``[..., V]``."""
        return processed_probs(logits, self.temperature, self.top_p)

    def draw(self, weights: torch.Tensor) -> torch.Tensor:
        """One id per row of non-negative ``weights [B, V]`` (normalised or not): int64 ``[B]``."""
        return torch.multinomial(weights, 1, generator=self.generator(weights.device))[:, 0]

    def sample(self, logits: torch.Tensor) -> torch.Tensor:
        """Plain sampling: one token per row of ``logits [B, V]`` from ``p``: int64 ``[B]``."""
        return self.draw(self.probs(logits))

    def draft(self, draft_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft per row of ``draft_logits [B, Vd]`` (draft-vocab ids): ``(draft ids [B], q [B, Vd] float32)``."""
        q = self.probs(draft_logits)
        return self.draw(q), q

    def verify(
        self,
        drafts: torch.Tensor,
        q_draft: torch.Tensor,
        targets: torch.Tensor,
        logits: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Speculative rejection sampling of a chain (``standard`` or ``block``, :attr:`method`).

        Args:
            drafts: int64 ``[B, k]`` verifier ids. q_draft: float32 ``[B, k, Vd]``.
            targets: int64 ``[Vd]`` verifier id of each draft id. logits: ``[B, k+1, V]``.

        Returns:
            ``(accepted [B] int64, tokens [B, k+1] int64)``: drafts before ``accepted``, then the
            residual or bonus token; later columns are never emitted.
        """
        B, k = drafts.shape
        V = logits.shape[-1]
        P = self.probs(logits)  # [B, k+1, V]
        Q = torch.zeros_like(P)  # [B, k+1, V]; row k stays 0: the bonus is sampled from p
        Q[:, :k].scatter_(2, targets.expand(B, k, -1), q_draft.float())
        p_x = P[:, :k].gather(2, drafts[..., None])[..., 0]  # [B, k]
        q_x = Q[:, :k].gather(2, drafts[..., None])[..., 0]  # [B, k]
        u = torch.rand(B, k, generator=self.generator(P.device), device=P.device)
        if self.method == "block":
            a, w_a = block_accept(p_x, q_x, P, Q, u)
        else:
            a = accept(p_x, q_x, u).long().cumprod(1).sum(1)  # [B] leading accepted drafts
            w_a = torch.ones(B, dtype=P.dtype, device=P.device)
        at = a[:, None, None].expand(B, 1, V)
        p_a, q_a = P.gather(1, at)[:, 0], Q.gather(1, at)[:, 0]  # [B, V]
        w = residual(w_a[:, None] * p_a, q_a)
        w = torch.where(w.sum(-1, keepdim=True) > 0, w, p_a)  # p == q to rounding: never rejected
        tokens = torch.cat([drafts, drafts[:, :1]], dim=1)  # [B, k+1]
        return a, tokens.scatter(1, a[:, None], self.draw(w)[:, None])


def make_sampler(
    temperature: float, top_p: float = 1.0, seed: int = SEED, method: Method = "standard"
) -> Optional[Sampler]:
    """A :class:`Sampler` at ``temperature`` > 0; None at temperature 0 (greedy decoding: ``top_p`` and
    ``method`` unused)."""
    return Sampler(temperature, top_p, seed, method) if temperature > 0 else None
