"""Helpers for the training tests: a tiny synthetic stage-02/03 output and a run YAML over it.

``make_tiny_run`` writes everything stage 04 reads, without a verifier:
speculators-v1 shards (``eagle3.shards.write.write_sample``) + ``data_config.json``, ``vocab_map.pt``,
``split.json``, 03's passing ``validation_record.json`` and data manifest (:func:`mark_validated`) and
``{train_dir}/target_head.safetensors``; the drafter shape is fully given in the
YAML, so the verifier path is never opened.

Run as a script it is one DDP worker: ``python tests/_ddp_worker.py CONFIG [--set k=v ...]`` under
``torchrun``-style env vars (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) trains on CPU with gloo.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from eagle3.data.vocab import save_vocab_map  # noqa: E402
from eagle3.shards.data_config import write_data_config  # noqa: E402
from eagle3.shards.format import FORMAT, LAYER_INDEX_CONVENTION
from eagle3.shards.write import write_sample
from eagle3.verifier.head import TargetHead  # noqa: E402


@pytest.fixture(autouse=True)
def single_thread():
    """Run each test with one intra-op thread: the tiny models here are dispatch-bound, and on a shared
    2-core CI machine two spinning threads per process make them several times slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def mark_validated(
    shards: Path, data: Path, stats: dict, freq: torch.Tensor, draft_vocab: int | None = None
) -> Path:
    """Write 03's passing validation record for the shard set as it is now and the data folder's manifest for it
    (what a passing 03 leaves; 04 refuses a set without them). ``stats``: ``num_samples``, ``num_tokens``,
    ``num_loss_tokens``, ``max_len``; ``freq``: int64 ``[V]`` loss-token counts; ``draft_vocab``: the manifest's
    ``draft_vocab_size`` (None: the one ``data`` records already; the other settings are the config defaults).
    Returns the record path."""
    from eagle3 import manifest
    from eagle3.data.validation_record import fingerprint_now, write_record

    fp = fingerprint_now(shards)
    settings = dict(val_fraction=0.05, seed=0, train_samples=None, exclude_id_prefixes=[])
    if draft_vocab is None:
        old = manifest.read(data, manifest.DataManifest)
        settings, draft_vocab = old.model_dump(include=set(settings)), old.draft_vocab_size
    made = manifest.DataManifest.make(
        shards_dir=str(shards.resolve()),
        shards_fingerprint=fp,
        draft_vocab_size=draft_vocab,
        **settings,
    )
    manifest.write(data, made)
    return write_record([shards, data], fp, stats, freq)


def make_tiny_run(
    root: Path,
    n_train: int = 8,
    n_val: int = 2,
    lengths=(12, 9, 16, 7),
    hidden: int = 16,
    vocab: int = 48,
    draft_vocab: int = 24,
    equal_lengths: bool = False,
    seed: int = 0,
    train: dict | None = None,
    pre_norm: bool = False,
    architecture: str = "LlamaForCausalLM",
    aux_layers: tuple = (2, 3, 4),
    verifier_weights: str | None = None,
) -> Path:
    """Write a tiny synthetic run under ``root`` and return its YAML path.

    Shards: ``n_train + n_val`` samples, lengths cycling through ``lengths`` (all ``lengths[0]`` when
    ``equal_lengths``), random bf16 hidden states ``[L, hidden]``, loss mask 1 after the first 2 tokens
    (all ones when ``equal_lengths``). Vocab map: draft ids = every ``vocab // draft_vocab``-th target id. Target head:
    random ``[vocab, hidden]`` embedding/lm_head (untied) and norm weight. ``architecture`` / ``aux_layers``: what
    ``data_config.json`` says the (6-layer) verifier and its captured layers are; ``verifier_weights``: the weights
    fingerprint it records (None: no key, as 02 writes for a folder without weight files).
    """
    g = torch.Generator().manual_seed(seed)
    shards = root / "shards"
    data = root / "data"
    n = n_train + n_val
    freq, stats = (
        torch.zeros(vocab, dtype=torch.int64),
        {"num_samples": n, "num_tokens": 0, "num_loss_tokens": 0, "max_len": 0},
    )
    for idx in range(n):
        L = lengths[0] if equal_lengths else lengths[idx % len(lengths)]
        ids = torch.randint(0, vocab, (L,), generator=g)  # [L]
        mask = (
            torch.ones(L, dtype=torch.int64) if equal_lengths else (torch.arange(L) >= 2).long()
        )  # [L]
        hs = [torch.randn(L, hidden, generator=g) for _ in range(4)]  # 4 x [L, H]
        write_sample(shards, idx, 4, ids, hs, mask)
        freq += torch.bincount(ids[mask.bool()], minlength=vocab)  # [V]
        stats.update(
            num_tokens=stats["num_tokens"] + L,
            num_loss_tokens=stats["num_loss_tokens"] + int(mask.sum()),
            max_len=max(stats["max_len"], L),
        )
    write_data_config(
        shards,
        {
            "format": FORMAT,
            "verifier": "synthetic",
            "architecture": architecture,
            "num_layers": 6,
            "hidden_size": hidden,
            "vocab_size": vocab,
            "aux_layers": list(aux_layers),
            "layer_index_convention": LAYER_INDEX_CONVENTION,
            "last_hidden_state": "pre_norm" if pre_norm else "post_norm",
            "dtype": "bfloat16",
            "max_length": max(lengths),
            "rows_per_dir": 4,
            "chat_template_hash": None,
            "config_fingerprint": "x",
            "prompts_sha256": "x",
            "num_samples": n,
            "num_tokens": 0,
            "num_loss_tokens": 0,
            "bytes_per_token": 8 * hidden,
            "skipped": {},
            **({"verifier_weights": verifier_weights} if verifier_weights else {}),
        },
    )
    data.mkdir(parents=True, exist_ok=True)
    mark_validated(shards, data, stats, freq, draft_vocab)
    stride = vocab // draft_vocab
    target_ids = torch.arange(
        0, stride * draft_vocab, stride
    )  # [dV] every stride-th id (identity if equal)
    d2t = target_ids - torch.arange(draft_vocab)  # [dV] offsets
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[target_ids] = True
    save_vocab_map(data / "vocab_map.pt", d2t, t2d)
    (data / "split.json").write_text(
        json.dumps({"train": list(range(n_train)), "val": list(range(n_train, n))})
    )
    train_dir = root / "train"
    TargetHead(
        embed=torch.randn(vocab, hidden, generator=g),
        lm_head=torch.randn(vocab, hidden, generator=g),
        norm_weight=1 + 0.1 * torch.randn(hidden, generator=g),
        norm_eps=1e-6,
        last_is_post_norm=not pre_norm,
    ).save(train_dir)
    cfg = {
        "run_name": "tiny",
        "output_root": str(root),
        "verifier": {
            "path": str(root / "no-verifier-needed"),
            "name": "synthetic",
        },  # the shards' (data_config)
        "prompts": {"source": "unused.jsonl"},
        "data": {"draft_vocab_size": draft_vocab},
        "drafter": {
            "hidden_size": hidden,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 4,
            "intermediate_size": 32,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "max_position_embeddings": 64,
        },
        "train": {
            "ttt_length": 3,
            "lr": 1e-2,
            "warmup_ratio": 0.25,
            "epochs": 2,
            "batch_size": 2,
            "grad_accum": 1,
            "log_every": 1,
            "ckpt_every": 2,
            "keep_checkpoints": 2,
            "seed": seed,
            **(train or {}),
        },
        "export": {"engine": "sglang"},
    }
    path = root / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def main(argv=None) -> int:
    import argparse

    from eagle3.config import add_config_args, load_config
    from eagle3.stages.export import export_for_run
    from eagle3.stages.train import run

    p = argparse.ArgumentParser()
    add_config_args(p)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--stop-after", type=int, default=None)
    p.add_argument(
        "--record",
        default=None,
        help="append the shard id of every training sample loaded to RECORD.<rank>",
    )
    p.add_argument(
        "--record-lr",
        default=None,
        help="append the lr of every optimizer step to RECORD_LR.<rank>",
    )
    a = p.parse_args(argv)
    import logging

    # warnings on stderr, each line naming its rank (tests count which ranks said what)
    logging.basicConfig(
        level=logging.WARNING, format=f"rank{os.environ.get('RANK', '0')} %(levelname)s %(message)s"
    )
    if a.record:
        record_loads(Path(f"{a.record}.{os.environ.get('RANK', '0')}"))
    if os.environ.get("HIDE_CHECKPOINTS_FROM_RANK") == os.environ.get(
        "RANK", "0"
    ):  # a node without the train folder
        from eagle3.train import checkpoint as ckpt

        ckpt.find_latest_checkpoint = lambda *args, **kwargs: None
    if (
        os.environ.get("SPLIT_DIR_FOR_RANK_1") and os.environ.get("RANK") == "1"
    ):  # a node with another data copy
        from eagle3.stages import train as trainer

        real = trainer.read_split
        trainer.read_split = lambda data_dir: real(
            os.environ["SPLIT_DIR_FOR_RANK_1"]
        )  # a folder with a split.json
    if a.record_lr:
        record_lrs(Path(f"{a.record_lr}.{os.environ.get('RANK', '0')}"))
    run(
        load_config(a.config, a.overrides),
        resume=a.resume,
        stop_after=a.stop_after,
        device="cpu",
        export=export_for_run,
    )
    return 0


def record_lrs(path: Path) -> None:
    """Append the learning rate of every optimizer step (``param_groups[0]["lr"]``, ``repr``) to ``path``, one per
    line: what each rank stepped with (DDP keeps ranks equal only when every rank steps with the same lr)."""

    def hook(optimizer, args, kwargs):
        with open(path, "a") as f:
            f.write(f"{optimizer.param_groups[0]['lr']!r}\n")

    from torch.optim.optimizer import register_optimizer_step_pre_hook

    register_optimizer_step_pre_hook(hook)


def record_loads(path: Path) -> None:
    """Make every ``ShardDataset`` item load append its shard id to ``path`` (one per line): which
    samples a run trained on (CPU loaders use no worker processes, so a load is a trained sample)."""
    from eagle3.data.dataset import ShardDataset

    orig = ShardDataset.__getitem__

    def getitem(self, i):
        with open(path, "a") as f:
            f.write(f"{self.indices[i]}\n")
        return orig(self, i)

    ShardDataset.__getitem__ = getitem


if __name__ == "__main__":
    sys.exit(main())
