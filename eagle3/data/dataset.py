"""Map-style dataset over the hidden-state shards, right-padding collate, resumable (distributed) sampler.

Stage 03 writes ``{data_dir}/split.json`` ``{"train": [idx...], "val": [idx...]}`` (sample ids of
the speculators-v1 shards in ``shards_dir``, DESIGN.md "Shards"). One item is one sample:

- ``input_ids`` int64 ``[L]``
- ``aux`` bf16 ``[L, 3*Ht]`` = ``cat(aux1, aux2, aux3)`` (EAGLE-3 feature order: low, mid, high)
- ``last`` bf16 ``[L, Ht]`` (the verifier's last hidden state, post- or pre-norm as recorded)
- ``loss_mask`` int64 ``[L]``
- fp8 shards (``eagle3.shards.fp8``): ``aux``/``last`` are float8_e4m3fn and ``aux_scale`` fp32 ``[L, 3nb]``,
  ``last_scale`` fp32 ``[L, nb]`` come along; stage 04 dequantises after the host->device copy.
- token-only samples (``eagle3-tokens-v1``, online training) and ``states=False``: ``input_ids`` and
  ``loss_mask`` only; stage 04 computes ``aux``/``last`` itself (:mod:`eagle3.train.online`).

truncated to ``max_length`` tokens. :func:`collate` pads on the right with token id 0, zero
features and loss mask 0; right padding is safe because drafter attention is causal, so real
positions never attend to padding, and padded positions are never counted (loss mask 0).

Order: :class:`ResumableSampler` is ``torch.utils.data.DistributedSampler`` (seeded shuffle per
epoch via ``set_epoch``, rank r takes indices ``r, r+W, ...``) that can start part-way into an
epoch, so a resumed run sees exactly the samples an uninterrupted run would have seen, also on
another number of processes (each sample at most once per epoch: the tail that does not fill
a last optimizer step is left out, see ``eagle3.train.order.TrainData.left_out_note``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator, Optional, Sequence

import torch
from torch.utils.data import Dataset, DistributedSampler

from eagle3.errors import UserError
from eagle3.io import read_json
from eagle3.shards.format import list_samples
from eagle3.shards.read import load_sample

PAD_TOKEN_ID = 0


def read_split(data_dir: str | os.PathLike) -> dict[str, list[int]]:
    """Read ``{data_dir}/split.json``.

    Returns:
        ``{"train": [idx...], "val": [idx...]}`` (lists of int sample ids).

    Raises:
        UserError: missing/malformed file, or a missing/non-integer ``train``/``val`` key.
    """
    path = Path(data_dir) / "split.json"
    split = read_json(path)
    if not isinstance(split, dict):
        raise UserError(f"{path}: expected a JSON object with keys 'train' and 'val'")
    out = {}
    for key in ("train", "val"):
        v = split.get(key)
        if not isinstance(v, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in v
        ):
            raise UserError(f"{path}: key '{key}' must be a list of integer sample ids")
        out[key] = v
    return out


class ShardDataset(Dataset):
    """Samples ``indices`` of the shards under ``shards_dir`` (nested or flat speculators layout).

    Args:
        shards_dir: stage-02 output folder.
        indices: sample ids (from ``split.json``), in dataset order.
        max_length: keep the first ``max_length`` tokens of each sample (``None`` = all).
        expect: passed to :func:`eagle3.shards.read.load_sample` (hidden size, vocab size checks).
        split_name: used in error messages (``split.json: key 'train'``...).
        split_file: the split file named in error messages (04 passes ``{data_dir}/split.json``).
        states: False = items without ``aux``/``last`` (online training over a hidden-state folder);
            token-only folders (``expect["tokens_only"]``) never have them.

    Raises:
        UserError: an id of the split has no shard file.
    """

    def __init__(
        self,
        shards_dir: str | os.PathLike,
        indices: Sequence[int],
        max_length: Optional[int] = None,
        expect: Optional[dict] = None,
        split_name: str = "train",
        states: bool = True,
        split_file: str | os.PathLike = "split.json",
    ):
        if max_length is not None and max_length < 2:
            raise UserError(f"train: max_length must be >= 2, got {max_length}")
        found = dict(list_samples(shards_dir))
        missing = [i for i in indices if i not in found]
        if missing:
            raise UserError(
                f"{split_file}: key '{split_name}': sample {missing[0]} has no shard in {shards_dir} "
                f"({len(missing)} missing)"
            )
        self.paths = [found[i] for i in indices]
        self.indices = list(indices)
        self.max_length = max_length
        self.expect = expect
        self.states = states and not (expect or {}).get("tokens_only", False)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        s = load_sample(self.paths[i], expect=self.expect)
        n = (
            s["input_ids"].numel()
            if self.max_length is None
            else min(self.max_length, s["input_ids"].numel())
        )
        if not self.states:
            return {
                "input_ids": s["input_ids"][:n],
                "loss_mask": s["loss_mask"][:n],
            }  # [L] int64 each
        hs = s["hidden_states"]
        item = {
            "input_ids": s["input_ids"][:n],  # [L] int64
            "aux": torch.cat(
                [h[:n] for h in hs[:3]], dim=-1
            ),  # [L, 3Ht] bf16 (fp8 shards: float8_e4m3fn)
            "last": hs[3][:n],  # [L, Ht] bf16 (fp8 shards: float8_e4m3fn)
            "loss_mask": s["loss_mask"][:n],  # [L] int64
        }
        if (
            "hidden_scales" in s
        ):  # fp8 shards: scales travel along, dequantised on the device (eagle3.shards.fp8)
            sc = s["hidden_scales"]
            item["aux_scale"] = torch.cat([x[:n] for x in sc[:3]], dim=-1)  # [L, 3nb] fp32
            item["last_scale"] = sc[3][:n]  # [L, nb] fp32
        return item


def loss_positions(loss_mask: torch.Tensor) -> torch.Tensor:
    """Flat indices ``b * L + p`` of the loss positions ``p >= 2`` of a padded batch.

    Args:
        loss_mask: int/bool ``[B, L]`` (1 on assistant tokens, 0 on prompt and padding).

    Returns:
        int64 ``[M]``, ascending (sample-major). Positions 0 and 1 are left out: no TTT step predicts them.
    """
    m = loss_mask.bool().clone()  # [B, L]
    m[:, :2] = False
    return m.reshape(-1).nonzero(as_tuple=True)[0]  # [M]


def collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Pad a list of :class:`ShardDataset` items on the right to the longest length ``Lmax``.

    Returns:
        ``input_ids`` int64 ``[B, Lmax]`` (pad 0), ``aux`` ``[B, Lmax, 3Ht]`` and ``last``
        ``[B, Lmax, Ht]`` (pad 0, dtype of the shards), ``loss_mask`` int64 ``[B, Lmax]`` (pad 0),
        ``attention_mask`` int64 ``[B, Lmax]`` (1 on real tokens), ``lengths`` int64 ``[B]``,
        ``loss_pos`` int64 ``[M]`` (flat indices ``b * Lmax + p`` of the loss positions ``p >= 2``,
        :func:`eagle3.data.dataset.loss_positions`; computed here, in the loader workers, so that the loss
        needs no device-to-host sync to find them); fp8 shards add ``aux_scale`` ``[B, Lmax, 3nb]`` and
        ``last_scale`` ``[B, Lmax, nb]`` (fp32, pad 0) for :func:`eagle3.shards.fp8.dequantize_batch`. Items
        without ``aux`` (token-only, online training) give a batch without ``aux`` and ``last``.
    """
    B = len(items)
    lengths = torch.tensor([it["input_ids"].numel() for it in items], dtype=torch.int64)  # [B]
    Lmax = int(lengths.max())
    ref = items[0]
    ids = torch.full((B, Lmax), PAD_TOKEN_ID, dtype=torch.int64)  # [B, Lmax]
    mask = torch.zeros((B, Lmax), dtype=torch.int64)  # [B, Lmax]
    attn = torch.zeros((B, Lmax), dtype=torch.int64)  # [B, Lmax]
    has_states = "aux" in ref
    aux = (
        torch.zeros((B, Lmax, ref["aux"].shape[-1]), dtype=ref["aux"].dtype) if has_states else None
    )  # [B, Lmax, 3Ht]
    last = (
        torch.zeros((B, Lmax, ref["last"].shape[-1]), dtype=ref["last"].dtype)
        if has_states
        else None
    )  # [B, Lmax, Ht]
    scales = {
        k: torch.zeros(
            (B, Lmax, ref[k].shape[-1]), dtype=ref[k].dtype
        )  # [B, Lmax, nb] (fp8 shards)
        for k in ("aux_scale", "last_scale")
        if k in ref
    }
    for b, it in enumerate(items):
        n = int(lengths[b])
        ids[b, :n] = it["input_ids"]
        mask[b, :n] = it["loss_mask"]
        attn[b, :n] = 1
        if has_states:
            aux[b, :n] = it["aux"]
            last[b, :n] = it["last"]
        for k, v in scales.items():
            v[b, :n] = it[k]
    out = {
        "input_ids": ids,
        "loss_mask": mask,
        "attention_mask": attn,
        "lengths": lengths,
        "loss_pos": loss_positions(mask),
        **scales,
    }
    if has_states:
        out.update(aux=aux, last=last)
    return out


class ResumableSampler(DistributedSampler):
    """``DistributedSampler`` that can start part-way into an epoch, for any number of processes.

    ``num_replicas``/``rank`` are given explicitly (1/0 without torch.distributed), ``drop_last``
    is True (every rank gets the same count, no duplicated samples), ``shuffle`` uses
    ``seed + epoch`` (PyTorch convention; call :meth:`set_epoch`).

    The epoch's order is one permutation of the dataset that does not depend on the process count
    (``torch.randperm(N, generator=seed + epoch)``, as ``DistributedSampler``); rank ``r`` takes
    positions ``r, r+W, ...``, so ``k`` optimizer steps of ``n`` global samples consume exactly the
    permutation's first ``k * n`` entries on any ``W``. :meth:`set_start` takes that global count
    (the checkpoint's ``samples_in_epoch``) and deals the REST of the permutation out to the
    current ranks (``W`` may differ from the run that wrote the checkpoint): every sample of the
    epoch is seen once, the tail that does not fill all ranks equally is dropped (``drop_last``).
    With ``start = 0`` the order is exactly ``DistributedSampler(drop_last=True)``'s.
    """

    def __init__(
        self,
        dataset: Dataset,
        num_replicas: int = 1,
        rank: int = 0,
        shuffle: bool = True,
        seed: int = 0,
    ):
        super().__init__(
            dataset,
            num_replicas=num_replicas,
            rank=rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=True,
        )
        self.start = 0

    def set_start(self, global_start: int) -> None:
        """Skip the first ``global_start`` samples of the epoch's permutation (all ranks together) at
        the next ``__iter__`` (reset by :meth:`set_epoch`)."""
        self.start = int(global_start)

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self.start = 0

    def epoch_order(self) -> list[int]:
        """The epoch's permutation of dataset positions (all ranks; ``DistributedSampler``'s seeding)."""
        if not self.shuffle:
            return list(range(len(self.dataset)))
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        return torch.randperm(len(self.dataset), generator=g).tolist()

    def __iter__(self) -> Iterator[int]:
        rest = self.epoch_order()[self.start :]
        per_rank = len(rest) // self.num_replicas
        return iter(rest[self.rank :: self.num_replicas][:per_rank])

    def __len__(self) -> int:
        return max(0, len(self.dataset) - self.start) // self.num_replicas
