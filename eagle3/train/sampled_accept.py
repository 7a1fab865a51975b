"""Expected acceptance of speculative rejection sampling per TTT step on held-out rows: 04's checkpoint
choice at ``train.select_temperature`` T > 0 (:class:`eagle3.train.sim_accept.BestTracker`).

``alpha_j = sum_x min(p_T(x), q_T(x))`` averaged over the held-out loss positions of TTT step ``j``
(:func:`eagle3.decoding.metrics.acceptance_probs`): ``p_T`` the verifier's full-vocab distribution and ``q_T`` the
drafter's over its draft vocab placed at the verifier ids ``d + d2t[d]``, both processed as 05 samples them
(:func:`eagle3.decoding.sampling.processed_probs`). Every loss position counts, also those whose verifier argmax is
outside the draft vocab.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from eagle3.data.dataset import loss_positions
from eagle3.decoding.metrics import acceptance_probs
from eagle3.decoding.sampling import processed_probs
from eagle3.losses.rows import row_targets
from eagle3.train.metrics import Accum

#: the validation keys of the sampled acceptance (:meth:`SampledAcceptance.summarize`): ``sampled_acc_{j}``
SAMPLED_KEY = "sampled_acc"


@torch.no_grad()
def sampled_acceptance_sums(
    drafter: nn.Module,
    step_hiddens: list[torch.Tensor],
    last_hidden: torch.Tensor,
    loss_pos: torch.Tensor,
    lm_head_weight: torch.Tensor,
    temperature: float,
    top_p: float = 1.0,
    norm_weight: Optional[torch.Tensor] = None,
    norm_eps: float = 1e-6,
    chunk: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-TTT-step sums of the acceptance probability ``sum_x min(p_T(x), q_T(x))`` over one batch's loss rows.

    Indexing as :func:`eagle3.losses.rows.ttt_loss_rows`: for the loss position ``p`` of sample ``b`` (flat index
    ``b * L + p``) the verifier distribution is that of row ``p - 1`` and step ``i``'s drafter hidden is row
    ``p - 2 - i``, counted iff ``p >= 2 + i``. ``p_T`` = :func:`processed_probs` of the verifier's full-vocab logits
    (``lm_head(norm(last))``, :func:`row_targets` with the identity vocab map) read at the draft tokens' verifier ids;
    ``q_T`` = :func:`processed_probs` of ``drafter.compute_logits`` over the draft vocab. ``chunk`` loss rows at a time
    (bounds the ``[chunk, V]`` verifier logits).

    Args:
        drafter: ``compute_logits`` and the buffer ``d2t`` (int64 ``[dV]``).
        step_hiddens: ``K`` tensors ``[B, L, H]`` from ``ttt_forward``.
        last_hidden: ``[B, L, Ht]`` the verifier's last hidden state.
        loss_pos: int64 ``[M]`` (:func:`eagle3.data.dataset.loss_positions`).
        lm_head_weight: ``[V, Ht]``; norm_weight / norm_eps: the verifier's final norm when ``last`` is pre-norm.
        temperature: > 0; top_p: in (0, 1].

    Returns:
        ``(alpha sums, counts)``: float64 ``[K]`` and int64 ``[K]`` on the hidden states' device.
    """
    B, L, H = step_hiddens[0].shape
    dev = step_hiddens[0].device
    V = lm_head_weight.shape[0]
    identity = (
        torch.zeros(V, dtype=torch.long, device=dev),
        torch.ones(V, dtype=torch.bool, device=dev),
    )
    cols = torch.arange(drafter.d2t.shape[0], device=dev) + drafter.d2t.to(dev)  # [dV] verifier ids
    loss_pos = loss_pos.to(dev)
    sums = torch.zeros(len(step_hiddens), dtype=torch.float64, device=dev)
    counts = torch.zeros(len(step_hiddens), dtype=torch.long, device=dev)
    for s in range(0, loss_pos.shape[0], chunk):
        pos = loss_pos[s : s + chunk]  # [n]
        full = row_targets(
            last_hidden, pos, lm_head_weight, *identity, norm_weight, norm_eps, chunk
        )
        p = processed_probs(full.logp_draft, temperature, top_p)[:, cols]  # [n, dV]
        for i, h in enumerate(step_hiddens):
            ok = pos % L >= 2 + i  # [n] the hidden row p-2-i exists
            hs = h.reshape(B * L, H)[(pos - 2 - i).clamp(min=0)]  # [n, H]
            q = processed_probs(drafter.compute_logits(hs), temperature, top_p)  # [n, dV]
            sums[i] += (acceptance_probs(p, q).double() * ok).sum()
            counts[i] += ok.sum()
    return sums, counts


class SampledAcceptance(Accum):
    """The held-out acceptance probability per TTT step at ``temperature`` (module docstring), summed over the
    validation batches without host syncs; :meth:`summarize` gives the ``sampled_acc_{j}`` keys.

    Args:
        ttt_length: ``K``; temperature: > 0; top_p: in (0, 1].

    Raises:
        ValueError: ``temperature <= 0`` (greedy selection needs no meter; a caller bug).
    """

    KEYS = ("alpha_sum", "alpha_count")

    def __init__(self, ttt_length: int, temperature: float, top_p: float = 1.0):
        if not temperature > 0:
            raise ValueError(f"SampledAcceptance needs a temperature > 0, got {temperature}")
        super().__init__(int(ttt_length))
        self.k, self.temperature, self.top_p = int(ttt_length), float(temperature), float(top_p)

    def add(
        self,
        drafter: nn.Module,
        batch: dict,
        lm_head_weight: torch.Tensor,
        norm_weight: Optional[torch.Tensor] = None,
        norm_eps: float = 1e-6,
    ) -> None:
        """One validation batch on the device (``input_ids``, ``aux``, ``last``, ``loss_mask``; ``loss_pos`` when
        listed): the drafter's TTT unroll and :func:`sampled_acceptance_sums`."""
        with torch.no_grad():
            hiddens = drafter.ttt_forward(batch["input_ids"], batch["aux"], self.k)  # K x [B, L, H]
        pos = batch["loss_pos"] if "loss_pos" in batch else loss_positions(batch["loss_mask"])
        a, c = sampled_acceptance_sums(
            drafter, hiddens, batch["last"], pos, lm_head_weight, self.temperature, self.top_p,
            norm_weight, norm_eps,
        )  # fmt: skip
        super().add({"alpha_sum": a, "alpha_count": c})  # totals(): the sums plus n (batches)

    @staticmethod
    def summarize(sums: dict[str, torch.Tensor]) -> dict[str, float]:
        """``sampled_acc_{j}`` = summed acceptance probability / counted rows of TTT step ``j`` (0 where none);
        {} when no batch was added on any rank."""
        if float(sums["n"]) == 0:
            return {}
        count = sums["alpha_count"].clamp(min=1)  # [K]
        return {f"{SAMPLED_KEY}_{j}": x for j, x in enumerate((sums["alpha_sum"] / count).tolist())}
