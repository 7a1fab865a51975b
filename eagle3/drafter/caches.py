"""The drafter's KV caches for decoding (stage 05): :class:`DrafterCache` (batched, growing) and
:class:`StaticKVCache` (one sequence, fixed capacity, CUDA-graph friendly; also the verifier's cache there).

Shapes: ``B`` batch, ``kvh`` key/value heads, ``S`` cached slots, ``C`` capacity, ``T`` new positions, ``hd``/``d``
head dim.
"""

from __future__ import annotations

from typing import Optional

import torch


class DrafterCache:
    """KV cache of the drafter for incremental, batched decoding.

    ``keys[l]`` / ``values[l]``: ``[B, kvh, S, hd]`` for decoder layer ``l`` (``DrafterArgs.num_layers`` of them;
    the lists grow on a layer's first :meth:`append`), rotary already applied to keys. All layers share the slots. ``length`` = ``S``, the number of cached slots (a Python int,
    so no host sync is needed to read it).

    Rows of a batch advance by different numbers of verified tokens per round, so a slot may hold
    a real position in one row and nothing in another: ``valid`` (bool ``[B, S]``, None while every
    slot of every row is real) marks the real ones, and :meth:`Eagle3Drafter.decode` masks the rest
    out of attention. A slot's rotary position is whatever ``position_ids`` said when it was
    written, so holes never shift positions.
    """

    def __init__(self, num_layers: int = 1):
        self.keys: list[Optional[torch.Tensor]] = [None] * num_layers
        self.values: list[Optional[torch.Tensor]] = [None] * num_layers
        self.valid: Optional[torch.Tensor] = None  # [B, S] bool, None = all slots valid

    @property
    def length(self) -> int:
        """Number of cached key slots."""
        return 0 if self.keys[0] is None else int(self.keys[0].shape[2])

    def append(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, valid: Optional[torch.Tensor] = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``[B, kvh, T, hd]`` keys/values to ``layer``; return the full ``[B, kvh, S+T, hd]`` tensors.

        ``valid`` (bool ``[B, T]``, None = all valid) marks which new slots hold real positions;
        it is recorded once per call of layer 0 (all layers share the slots).
        """
        while layer >= len(self.keys):
            self.keys.append(None)
            self.values.append(None)
        if layer == 0 and (valid is not None or self.valid is not None):
            B, T = k.shape[0], k.shape[2]
            new = (
                torch.ones(B, T, dtype=torch.bool, device=k.device)
                if valid is None
                else valid.to(torch.bool)
            )  # [B, T]
            if self.valid is None:
                old = torch.ones(B, self.length, dtype=torch.bool, device=k.device)  # [B, S]
            else:
                old = self.valid
            self.valid = torch.cat([old, new], dim=1)  # [B, S+T]
        if self.keys[layer] is not None:
            k = torch.cat([self.keys[layer], k], dim=2)
            v = torch.cat([self.values[layer], v], dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v

    def attention_mask(self, T: int) -> Optional[torch.Tensor]:
        """Boolean mask ``[B, 1, T, S]`` for the last ``T`` slots as queries (call after :meth:`append`).

        A query sees every valid slot up to its own (causal by slot order) and always its own slot
        (so that a padding query, whose output is never used, is not fully masked). None when no
        slot is invalid (plain causal attention suffices).
        """
        if self.valid is None:
            return None
        S = self.valid.shape[1]
        past = S - T
        causal = torch.ones(T, S, dtype=torch.bool, device=self.valid.device).tril(
            diagonal=past
        )  # [T, S]
        own = torch.zeros(T, S, dtype=torch.bool, device=self.valid.device)
        own[:, past:] = torch.eye(T, dtype=torch.bool, device=self.valid.device)  # [T, S]
        return ((self.valid[:, None, :] & causal) | own)[:, None]  # [B, 1, T, S]

    def crop(self, n: int) -> None:
        """Keep only the first ``n`` slots (drop drafted tokens).

        Raises:
            ValueError: ``n`` is negative or larger than :attr:`length`.
        """
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot crop a drafter cache of length {self.length} to {n}")
        for j in range(len(self.keys)):
            if self.keys[j] is not None:
                self.keys[j] = self.keys[j][:, :, :n]
                self.values[j] = self.values[j][:, :, :n]
        if self.valid is not None:
            self.valid = self.valid[:, :n]

    def clone(self) -> "DrafterCache":
        """A shallow copy (tensors are shared; crop/append never modify them in place)."""
        c = DrafterCache(len(self.keys))
        c.keys, c.values, c.valid = list(self.keys), list(self.values), self.valid
        return c


class StaticKVCache:
    """Position-aligned KV cache of ONE sequence with a fixed capacity: column ``p`` holds position ``p``.

    Used by the batch-1 static decoder of stage 05 (:mod:`eagle3.decoding.static_decode`) for the drafter
    (:meth:`Eagle3Drafter.decode_static`) and for the verifier's layers alike. Writes go to the columns of the new
    positions (``index_copy_``, a device index: no host sync) and a query at position ``p`` attends columns ``<= p``
    (:meth:`mask`), so a rejected draft's keys are never cropped: the next forward at those positions overwrites
    them, and until then they lie beyond every query. Every shape is fixed, so the forwards can be captured as CUDA
    graphs.

    Attributes:
        capacity: columns ``C`` (positions ``0..C-1``).
        k, v: per layer ``[1, kvh, C, d]`` (allocated at the layer's first write, in the dtype and head sizes of the
            keys/values written: MLA's key and value head sizes differ).
        columns: int64 ``[C]``, ``arange(C)``.
        pos, attn_mask: the positions ``[T]`` of the forward in flight and their mask ``[1, 1, T, C]`` (set by the
            caller before a verifier forward: every layer reads the same ones).
    """

    def __init__(self, capacity: int, num_layers: int = 1, device=None):
        if capacity < 1 or num_layers < 1:
            raise ValueError("StaticKVCache: capacity and num_layers >= 1")
        self.capacity = capacity
        self.k: list[Optional[torch.Tensor]] = [None] * num_layers
        self.v: list[Optional[torch.Tensor]] = [None] * num_layers
        self.columns = torch.arange(capacity, device=device)  # [C]
        self.pos: Optional[torch.Tensor] = None
        self.attn_mask: Optional[torch.Tensor] = None

    def mask(self, pos: torch.Tensor) -> torch.Tensor:
        """Bool ``[1, 1, T, C]``: query ``i`` (at position ``pos[i]``, int64 ``[T]``) attends columns ``<= pos[i]``."""
        return (self.columns[None, :] <= pos[:, None])[None, None]  # [1, 1, T, C]

    def set_forward(self, pos: torch.Tensor) -> None:
        """Record the positions ``[T]`` of the next forward and their :meth:`mask` (read by every layer)."""
        self.pos, self.attn_mask = pos, self.mask(pos)

    def write(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``k``/``v`` ``[1, kvh, T, d]`` at columns ``pos`` (int64 ``[T]``, each ``< C``) of ``layer``; return the
        layer's whole ``[1, kvh, C, d]`` tensors."""
        if self.k[layer] is None:
            self.k[layer] = k.new_zeros(1, k.shape[1], self.capacity, k.shape[3])
            self.v[layer] = v.new_zeros(1, v.shape[1], self.capacity, v.shape[3])
        kc, vc = self.k[layer], self.v[layer]
        kc.index_copy_(2, pos, k.to(kc.dtype))
        vc.index_copy_(2, pos, v.to(vc.dtype))
        return kc, vc
