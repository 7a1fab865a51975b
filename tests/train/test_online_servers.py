"""Online training against capture servers (``train.hidden_states: online``, ``extract.backend: sglang``).

The stand-in patched SGLang servers of tests/capture/test_capture_sglang.py (SGLang 0.5.23's endpoints,
capture files written by the patch's own code, a seeded-embedding "verifier" with exact states). Stage 02
writes hidden-state shards from one server (offline) and token-only samples (online); 04 trains offline on
the shards and online from the servers through 02's client, with a bounded prefetch queue:

- online == offline bitwise (losses, final weights): the same states reach the same trainer steps;
- two servers, one failing mid-run (HTTP 500, or its connection dropped and the server gone): the batches
  fail over, training gives the same losses and weights, and every sample is captured exactly once per use
  (each training sample once per epoch, each validation sample once per validation): none lost or duplicated.
"""

from __future__ import annotations

import collections
import json
from pathlib import Path

import pytest
import torch
import yaml
from test_capture_multi import standin_servers
from test_capture_sglang import H, V, ec
from test_extract import _write_prompts

from eagle3.capture.sglang import SGLangCapture
from eagle3.config import load_config
from eagle3.train import checkpoint as ckpt
from eagle3.verifier.head import TargetHead

AUX = [3, 31, 59]
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron".split()
CONVS = [
    (
        f"q{i}",
        [
            ("user", f"Question {i}: list {i % 5 + 1} words."),
            (
                "assistant",
                "Sure: " + " ".join(WORDS[(i + k) % len(WORDS)] for k in range(2 + (5 * i) % 9)),
            ),
        ],
    )
    for i in range(10)
]
TRAIN = {
    "ttt_length": 2,
    "lr": 3e-3,
    "warmup_ratio": 0.25,
    "epochs": 2,
    "batch_size": 1,
    "grad_accum": 2,
    "log_every": 1,
    "ckpt_every": 4,
    "keep_checkpoints": 2,
    "eval_every": 100,
    "seed": 0,
    "online_prefetch": 2,
}


@pytest.fixture()
def servers(tmp_path, monkeypatch):
    """Two stand-in capture servers, each with its own capture folder."""
    yield from standin_servers(tmp_path, monkeypatch, 2)


def _yaml(
    root: Path, tiny: Path, online: bool, sts, shards: Path | None = None, data: Path | None = None
) -> Path:
    cfg = {
        "run_name": "online-servers",
        "output_root": str(root),
        "verifier": {"path": str(tiny), "name": "standin", "dtype": "float32", "device": "cpu"},
        "prompts": {"source": "humaneval"},
        "extract": {
            "backend": "sglang",
            "aux_layers": AUX,
            "max_length": 64,
            "batch_tokens": 40,
            "rows_per_dir": 4,
            "disk_margin_bytes": 0,
            "sglang_url": [s.url for s in sts],
            "capture_dir": [str(s.capture_dir) for s in sts],
            "server_max_failures": 2,
            "batches_in_flight_per_server": 1,
            "sglang_timeout_s": 30,
            **({"output_dir": str(shards)} if shards else {}),
        },
        # the full vocab: the random stand-in head's argmax is then always a draft id (every position counts)
        "data": {
            "draft_vocab_size": V,
            "val_fraction": 0.2,
            **({"output_dir": str(data)} if data else {}),
        },
        "drafter": {
            "hidden_size": H,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 4,
            "intermediate_size": 16,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "max_position_embeddings": 2048,
        },
        "train": {**TRAIN, "hidden_states": "online" if online else "offline"},
        "export": {"dtype": "float32"},
    }
    root.mkdir(parents=True, exist_ok=True)
    path = root / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _prepare(root: Path, tiny: Path, online: bool, st, tokenizer):
    """02 (one server, passed in as stage 02's tests do) + 03."""
    from eagle3.stages import extract, prepare_data

    _write_prompts(root / "prompts.jsonl", CONVS)
    cfg = load_config(_yaml(root, tiny, online, [st]))
    be = SGLangCapture(url=st.url, capture_dir=st.capture_dir, aux_layers=AUX, timeout=30)
    ex = extract.run(cfg, backend=be, tokenizer=tokenizer)
    prepare_data.run(cfg, plot=False)
    return cfg, ex


def _train(tmp: Path, tiny: Path, online: bool, sts, src) -> "RunConfig":  # noqa: F821
    from eagle3.stages.train import run

    cfg = load_config(_yaml(tmp, tiny, online, sts, shards=src.shards_dir, data=src.data_dir))
    g = torch.Generator().manual_seed(
        1
    )  # the stand-in verifier's head: [V, H] random, post-norm states
    TargetHead(
        embed=torch.randn(V, H, generator=g),
        lm_head=torch.randn(V, H, generator=g),
        norm_weight=torch.ones(H),
        norm_eps=1e-6,
        last_is_post_norm=True,
    ).save(cfg.train_dir)
    r = run(cfg, device="cpu")
    assert r["step"] == 8 and not r["stopped"]  # 8 train samples / (1 x 2) per step x 2 epochs
    return cfg


def _losses(train_dir: Path) -> list[float]:
    rows = [json.loads(x) for x in (train_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r["kind"] in ("train", "val")]


def _weights(train_dir: Path) -> dict:
    return ckpt.load_checkpoint(ckpt.list_checkpoints(train_dir)[-1][1])["model"]


def _ids_of(cfg, split: str) -> list[tuple[int, ...]]:
    from eagle3.data.dataset import read_split
    from eagle3.shards.format import list_samples

    paths = dict(list_samples(cfg.shards_dir))
    return [
        tuple(torch.load(paths[i], weights_only=True)["input_ids"].tolist())
        for i in read_split(cfg.data_dir)[split]
    ]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["500", "refuse"])
def test_online_from_servers_one_failing_equals_offline(
    tmp_path, servers, tiny_llama_dir, smollm_tokenizer, mode
):
    a, b = servers
    off_src, _ = _prepare(tmp_path / "off-data", tiny_llama_dir, False, a, smollm_tokenizer)
    on_src, ex = _prepare(tmp_path / "on-data", tiny_llama_dir, True, a, smollm_tokenizer)
    assert (
        ex["samples"] == 10
        and json.loads((on_src.shards_dir / "data_config.json").read_text())["format"]
        == "eagle3-tokens-v1"
    )
    off = _train(tmp_path / "off", tiny_llama_dir, False, [a], off_src)
    on1 = _train(tmp_path / "on1", tiny_llama_dir, True, [a], on_src)  # one healthy server
    want_loss, want_w = _losses(off.train_dir), _weights(off.train_dir)
    assert (
        len(want_loss) == 9 and want_loss[0] != want_loss[7]
    )  # 8 steps + the final validation; it trained
    assert _losses(on1.train_dir) == want_loss
    assert all(torch.equal(v, want_w[k]) for k, v in _weights(on1.train_dir).items())

    a.posts.clear()
    b.posts.clear()
    b.received, b.fail_after, b.fail_mode = (
        0,
        2,
        mode,
    )  # b answers two batches, then fails every request
    on2 = _train(tmp_path / "on2", tiny_llama_dir, True, [a, b], on_src)
    assert _losses(on2.train_dir) == want_loss
    assert all(torch.equal(v, want_w[k]) for k, v in _weights(on2.train_dir).items())
    answered = a.posts + b.posts[:2]
    assert len(b.posts) > 2  # b failed at least one batch mid-run, which went to a
    captured = collections.Counter(tuple(ids) for post in answered for ids in post["input_ids"])
    want = collections.Counter(_ids_of(on_src, "train") * 2 + _ids_of(on_src, "val"))
    assert captured == want  # every sample exactly once per epoch (train) / per validation (val)
    for st in (a, b):  # every capture file was read and deleted
        assert sorted(p.name for p in st.capture_dir.iterdir()) == [ec.INFO_FILE]


def test_online_servers_disagreeing_with_the_samples_is_user_error(
    tmp_path, servers, tiny_llama_dir, smollm_tokenizer
):
    from eagle3.errors import UserError
    from eagle3.train.online import ServerStates

    a, _b = servers
    on_src, _ = _prepare(tmp_path / "on-data", tiny_llama_dir, True, a, smollm_tokenizer)
    meta = json.loads((on_src.shards_dir / "data_config.json").read_text())
    with pytest.raises(UserError, match="key 'hidden_size' is 16 but the capture server"):
        ServerStates.connect(
            on_src.extract,
            on_src.train.online_prefetch,
            {**meta, "hidden_size": 16},
            torch.device("cpu"),
        )


def test_captured_batches_prefetch_in_order_and_close():
    """CapturedBatches: at most ``depth`` batches captured ahead of the one handed out, results in order,
    states collated as shards collate (zero padding); close() stops it."""
    import threading

    from eagle3.data.dataset import collate
    from eagle3.train.online import CapturedBatches

    started, lock = [], threading.Lock()

    class Backend:
        aux_layers = AUX

        def capture(self, batch):
            with lock:
                started.append(batch[0][0])
            return [
                [torch.full((len(s), 4), float(s[0] + k), dtype=torch.bfloat16) for k in range(4)]
                for s in batch
            ]

    def token_batches():
        for i in range(6):
            yield collate(
                [
                    {
                        "input_ids": torch.tensor([10 * i + 1, 2, 3]),
                        "loss_mask": torch.ones(3, dtype=torch.long),
                    },
                    {
                        "input_ids": torch.tensor([10 * i + 5]),
                        "loss_mask": torch.ones(1, dtype=torch.long),
                    },
                ]
            )

    it = CapturedBatches(token_batches(), Backend(), hidden_size=4, depth=2)
    first = next(it)
    assert len(started) <= 3  # the one handed out + at most 2 ahead
    assert first["aux"].shape == (2, 3, 12) and first["last"].dtype == torch.bfloat16
    assert torch.equal(first["aux"][0, :, :4], torch.full((3, 4), 1.0, dtype=torch.bfloat16))
    assert torch.equal(first["last"][1, 0], torch.full((4,), 5.0 + 3, dtype=torch.bfloat16))
    assert not first["aux"][1, 1:].any()  # padding stays zero, as collate pads shard states
    rest = list(it)
    assert [int(b["input_ids"][0, 0]) for b in rest] == [11, 21, 31, 41, 51]
    it2 = CapturedBatches(token_batches(), Backend(), hidden_size=4, depth=2)
    next(it2)
    it2.close()
    assert list(it2) == []


def test_attach_states_refuses_nonfinite_capture():
    from eagle3.data.dataset import collate
    from eagle3.errors import UserError
    from eagle3.train.online import attach_states

    batch = collate(
        [{"input_ids": torch.tensor([1, 2, 3]), "loss_mask": torch.ones(3, dtype=torch.long)}]
    )
    good = [[torch.ones(3, 4, dtype=torch.bfloat16) for _ in range(4)]]
    assert attach_states(batch, good, 4)["last"].shape == (1, 3, 4)
    bad = [[t.clone() for t in good[0]]]
    bad[0][2][1, 3] = float("inf")
    with pytest.raises(UserError, match="NaN/Inf in a captured batch of 1 samples"):
        attach_states(batch, bad, 4)
