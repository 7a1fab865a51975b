"""A stand-in drafter that always proposes the verifier's own greedy tokens (an "oracle").

It implements the interface :mod:`eagle3.decoding.decode` uses (``project``, ``decode``, ``compute_logits``,
``draft_to_target``, identity draft vocab) over a known continuation per row: the hidden output at
rotary position ``p`` carries ``p`` (and the row) in its first two channels, and ``compute_logits``
puts all mass on the token at ``p + 2`` of that row's prompt + greedy sequence, which is exactly what
a perfect EAGLE-3 drafter predicts from position ``p`` (DESIGN.md TTT indexing: the output at ``t``
drafts ``x_{t+2}``; drafted step ``i`` at position ``t+i`` drafts ``x_{t+2+i}``). Keys/values of
width 1 keep :class:`eagle3.drafter.caches.DrafterCache` bookkeeping real (append, crop).
"""

from __future__ import annotations

import torch
from torch import nn


class OracleDrafter(nn.Module):
    """Proposes ``sequences[row][p + 2]`` from position ``p``.

    Args:
        sequences: per batch row, prompt ids + the verifier's greedy continuation (long enough for
            every position the decoder reaches: ``len(prompt) + max_new_tokens + steps + 2``).
        vocab_size: the verifier's vocabulary (draft vocab = target vocab, ``d2t = 0``).
        hidden_size: width of the fake hidden state (>= 2).
    """

    def __init__(self, sequences: list[list[int]], vocab_size: int, hidden_size: int = 8):
        super().__init__()
        width = max(len(s) for s in sequences)
        table = torch.zeros(len(sequences), width, dtype=torch.long)  # [B, W]
        for r, s in enumerate(sequences):
            table[r, : len(s)] = torch.tensor(s)
        self.register_buffer("table", table)
        self.register_buffer("d2t", torch.zeros(vocab_size, dtype=torch.long))
        self.V, self.H = vocab_size, hidden_size
        self.anchor = nn.Parameter(
            torch.zeros(1)
        )  # so that next(parameters()) names a device/dtype

    def project(self, aux: torch.Tensor) -> torch.Tensor:
        return torch.zeros(
            *aux.shape[:-1], self.H, dtype=torch.float32, device=aux.device
        )  # [B, T, H]

    def decode(self, input_ids, hidden, position_ids, cache, valid=None, rows=None):
        B, T = input_ids.shape
        kv = torch.zeros(B, 1, T, 1, device=input_ids.device)  # [B, 1, T, 1]
        if hasattr(cache, "append"):
            try:
                cache.append(0, kv, kv, valid)
            except TypeError:
                cache.append(0, kv, kv)
        h = torch.zeros(B, T, self.H, device=input_ids.device)  # [B, T, H]
        h[..., 0] = position_ids.float()
        row_ids = torch.arange(B, device=input_ids.device) if rows is None else rows
        h[..., 1] = row_ids.float()[:, None]
        return h

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        pos = h[..., 0].long()  # [.., ]
        row = h[..., 1].long()
        tok = self.table[row, (pos + 2).clamp(max=self.table.shape[1] - 1)]
        return torch.nn.functional.one_hot(tok, self.V).float()  # [.., V]

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def decode_static(self, input_ids, hidden, position_ids, cache):
        """Batch 1 over a static cache (:meth:`eagle3.drafter.model.Eagle3Drafter.decode_static`): the same fake outputs."""
        T = input_ids.shape[1]
        h = torch.zeros(1, T, self.H, device=input_ids.device)  # [1, T, H]
        h[..., 0] = position_ids.float()
        return h
