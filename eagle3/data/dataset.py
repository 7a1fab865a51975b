"""Map-style dataset over the hidden-state shards, right-padding collate, resumable sampler.

An item (one sample of ``split.json``, cut to ``max_length``): ``input_ids`` int64 ``[L]``, ``aux`` ``[L, 3Ht]``
(``cat`` of the low, mid, high states), ``last`` ``[L, Ht]``, ``loss_mask`` int64 ``[L]``; bf16, or float8_e4m3fn
with ``aux_scale`` fp32 ``[L, 3nb]`` / ``last_scale`` ``[L, nb]`` (:mod:`eagle3.shards.fp8`, dequantised on the
device); token-only folders and ``states=False``: ``input_ids`` and ``loss_mask`` only (:mod:`eagle3.train.online`).
Right padding is safe: the drafter's attention is causal and padding has loss mask 0.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator, Optional, Sequence

import torch
from pydantic import BaseModel, StrictInt
from torch.utils.data import Dataset, DistributedSampler

from eagle3.errors import UserError, validated
from eagle3.io import read_json
from eagle3.shards.format import list_samples
from eagle3.shards.read import load_sample

PAD_TOKEN_ID = 0


class Split(BaseModel):
    """03's ``split.json``: the sample ids of each split, in order."""

    train: list[StrictInt]
    val: list[StrictInt]


def read_split(data_dir: str | os.PathLike) -> dict[str, list[int]]:
    """``{data_dir}/split.json`` as ``{"train": [idx...], "val": [idx...]}``.

    Raises:
        UserError: ``split.json: field 'val' ...; re-run 03_prepare_data.py`` (:func:`eagle3.errors.validated`).
    """
    path = Path(data_dir) / "split.json"
    return validated(Split, read_json(path), str(path), "re-run 03_prepare_data.py").model_dump()


class ShardDataset(Dataset):
    """Samples ``indices`` (split ids, in order) of the shards under ``shards_dir``; ``expect`` goes to
    :func:`eagle3.shards.read.load_sample`; ``split_name`` / ``split_file`` name the split in errors; ``states=False``:
    items without ``aux``/``last``.

    ``max_length``: 02's ``extract.max_length`` (``ExtractConfig``: >= 8), or None for whole samples.

    Raises:
        UserError: a split id without a shard file.
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
        n = s["input_ids"].numel()
        n = n if self.max_length is None else min(self.max_length, n)
        item = {"input_ids": s["input_ids"][:n], "loss_mask": s["loss_mask"][:n]}  # [L] int64
        if not self.states:
            return item
        hs = s["hidden_states"]
        item["aux"] = torch.cat([h[:n] for h in hs[:3]], dim=-1)  # [L, 3Ht]
        item["last"] = hs[3][:n]  # [L, Ht]
        if "hidden_scales" in s:  # fp8 shards
            sc = s["hidden_scales"]
            item["aux_scale"] = torch.cat([x[:n] for x in sc[:3]], dim=-1)  # [L, 3nb] fp32
            item["last_scale"] = sc[3][:n]  # [L, nb] fp32
        return item


def loss_positions(loss_mask: torch.Tensor) -> torch.Tensor:
    """int64 ``[M]`` ascending flat indices ``b * L + p`` of the loss positions ``p >= 2`` of ``loss_mask`` ``[B, L]``
    (no TTT step predicts positions 0 and 1).
    """
    m = loss_mask.bool().clone()  # [B, L]
    m[:, :2] = False
    return m.reshape(-1).nonzero(as_tuple=True)[0]  # [M]


def collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Right-pad items to ``Lmax``: ``input_ids``, ``loss_mask``, ``attention_mask`` int64 ``[B, Lmax]`` (pad 0),
    ``lengths`` ``[B]``, ``loss_pos`` ``[M]`` (:func:`loss_positions`, found here in the loader workers so the loss
    needs no host sync), and when the items have states ``aux`` ``[B, Lmax, 3Ht]``, ``last`` ``[B, Lmax, Ht]`` and the
    fp8 ``aux_scale`` / ``last_scale`` (zero padded).
    """
    B = len(items)
    lengths = torch.tensor([it["input_ids"].numel() for it in items], dtype=torch.int64)  # [B]
    Lmax = int(lengths.max())
    ref = items[0]
    ids = torch.full((B, Lmax), PAD_TOKEN_ID, dtype=torch.int64)  # [B, Lmax]
    mask = torch.zeros((B, Lmax), dtype=torch.int64)  # [B, Lmax]
    attn = torch.zeros((B, Lmax), dtype=torch.int64)  # [B, Lmax]
    feats = {  # [B, Lmax, 3Ht], [B, Lmax, Ht], fp8 scales [B, Lmax, nb]
        k: torch.zeros((B, Lmax, ref[k].shape[-1]), dtype=ref[k].dtype)
        for k in ("aux", "last", "aux_scale", "last_scale")
        if k in ref
    }
    for b, it in enumerate(items):
        n = int(lengths[b])
        ids[b, :n] = it["input_ids"]
        mask[b, :n] = it["loss_mask"]
        attn[b, :n] = 1
        for k, v in feats.items():
            v[b, :n] = it[k]
    out = {"input_ids": ids, "loss_mask": mask, "attention_mask": attn, "lengths": lengths}
    return {**out, "loss_pos": loss_positions(mask), **feats}


class ResumableSampler(DistributedSampler):
    """``DistributedSampler(drop_last=True)`` (seed ``seed + epoch``, rank ``r`` takes ``r, r+W, ...`` of one
    process-count-independent permutation) that can start part-way into an epoch: :meth:`set_start` skips the first
    ``global_start`` samples (a checkpoint's ``samples_in_epoch``) and deals the rest to the current ranks, so a
    resume on any process count sees each sample of the epoch once.
    """

    def __init__(
        self,
        dataset: Dataset,
        num_replicas: int = 1,
        rank: int = 0,
        shuffle: bool = True,
        seed: int = 0,
    ):
        super().__init__(dataset, num_replicas, rank, shuffle, seed, drop_last=True)
        self.start = 0

    def set_start(self, global_start: int) -> None:
        """Skip the first ``global_start`` samples of the epoch's permutation (reset by :meth:`set_epoch`)."""
        self.start = int(global_start)

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self.start = 0

    def epoch_order(self) -> list[int]:
        """The epoch's permutation of dataset positions (all ranks)."""
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
