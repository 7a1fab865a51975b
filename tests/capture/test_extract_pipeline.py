"""Pipelined stage 02 (capture of batch k+1 overlapping the host copy and background shard writes
of batch k) against the serial loop: the same bytes on disk, the same manifest; the writer's
ordering and error rules; the hooked capture against ``output_hidden_states``."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from test_capture_hf import SAMPLES, _deepseek, _llama
from test_extract import _config, _write_prompts

import eagle3.capture.shard_writer as sw
from eagle3.config import load_config
from eagle3.errors import UserError
from eagle3.shards.manifest import ManifestWriter, read_manifest
from eagle3.stages.extract import run

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron".split()
CONVS = [
    (
        f"q{i}",
        [
            ("user", f"Question {i}: list {i % 5 + 1} words."),
            (
                "assistant",
                "Sure: " + " ".join(WORDS[(i + k) % len(WORDS)] for k in range(2 + (5 * i) % 13)),
            ),
        ],
    )
    for i in range(17)
] + [("q17", [("user", "no answer")])]


def _tree(root: Path) -> dict[str, bytes]:
    """Every file this stage wrote, by relative path (reports hold timings: left out)."""
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.name.startswith(("extract_report", "extract_state", ".extract"))
    }


@pytest.mark.parametrize("threads", [1, 3])
def test_pipelined_writer_gives_the_serial_bytes(tmp_path, tiny_llama_dir, threads):
    outs = {}
    for name, wt in (("serial", 0), ("pipelined", threads)):
        cfg_path = _config(
            tmp_path / name, tiny_llama_dir, batch_tokens=100, rows_per_dir=4, write_threads=wt
        )
        _write_prompts(tmp_path / name / "out" / "prompts.jsonl", CONVS)
        res = run(load_config(cfg_path))
        assert res["written"] == 17 and res["samples"] == 17
        outs[name] = _tree(tmp_path / name / "out" / "shards")
    ser, pip = outs["serial"], outs["pipelined"]
    assert sum(k.endswith(".pt") for k in ser) == 17
    assert ser.keys() == pip.keys()
    for k in ser:
        if k == "data_config.json":  # names its own prompts file path; everything else equal
            continue
        assert ser[k] == pip[k], k
    # several batches, so the overlap really happened, and the manifest is in plan order (not idx order)
    rows = [
        r for r in read_manifest(tmp_path / "serial" / "out" / "shards" / "manifest.jsonl").rows
    ]
    assert len(rows) == 17
    lines = (tmp_path / "pipelined" / "out" / "shards" / "manifest.jsonl").read_text().splitlines()
    assert [int(x.split(",")[0].split(":")[1]) for x in lines] != sorted(range(17))


def test_token_only_writer_processes_give_the_serial_bytes(tmp_path, tiny_llama_dir, monkeypatch):
    """Token-only 02 (online training) through worker processes, in groups that straddle the batches, writes
    the serial loop's files and manifest byte for byte."""
    import yaml

    import eagle3.shards.format as shard_format

    monkeypatch.setattr(shard_format, "TOKEN_PROCESS_MIN", 1)
    monkeypatch.setattr(sw, "GROUP_SIZE", 3)
    pools = []
    real_pool = sw.ProcessPoolExecutor
    monkeypatch.setattr(
        sw, "ProcessPoolExecutor", lambda *a, **k: pools.append(a) or real_pool(*a, **k)
    )
    outs = {}
    for name, wt in (("serial", 0), ("processes", 2)):
        cfg_path = _config(
            tmp_path / name, tiny_llama_dir, batch_tokens=100, rows_per_dir=4, write_threads=wt
        )
        d = yaml.safe_load(cfg_path.read_text())
        d["train"] = {"hidden_states": "online"}
        cfg_path.write_text(yaml.safe_dump(d))
        _write_prompts(tmp_path / name / "out" / "prompts.jsonl", CONVS)
        res = run(load_config(cfg_path))
        assert res["written"] == 17
        outs[name] = _tree(tmp_path / name / "out" / "shards")
    ser, pro = outs["serial"], outs["processes"]
    assert pools == [(2,)]  # the process path ran (once: the processes run), the serial one did not
    assert sum(k.endswith(".pt") for k in ser) == 17 and ser.keys() == pro.keys()
    for k in ser:
        if k != "data_config.json":
            assert ser[k] == pro[k], k
    shard = next(p for p in sorted((tmp_path / "processes" / "out" / "shards").rglob("*.pt")))
    first = torch.load(shard, weights_only=True)
    assert set(first) == {"input_ids", "loss_mask"}  # token-only


def test_process_writer_refuses_hidden_states(tmp_path):
    with (
        ManifestWriter(tmp_path / "m.jsonl") as man,
        sw.ShardWriter(tmp_path, 4, man, threads=2, processes=True) as w,
    ):
        with pytest.raises(ValueError, match="token-only samples only"):
            w.submit(0, "p0", [1, 2], [torch.zeros(2, 4)] * 4, [0, 1])


def _fake_write(delays: dict[int, float], fail: set[int], log: list):
    def write(
        root, idx, rows_per_dir, input_ids, states, loss_mask, storage=None, checksum="xxh3_128"
    ):
        time.sleep(delays.get(idx, 0.0))
        if idx in fail:
            raise UserError(f"{root}/data_{idx}.pt: disk full")
        log.append(idx)
        return f"sha-{idx}"

    return write


def test_writer_appends_in_submission_order_whatever_finishes_first(tmp_path, monkeypatch):
    done: list[int] = []
    # later submissions finish first
    monkeypatch.setattr(sw, "_write_one", _fake_write({0: 0.3, 1: 0.2, 2: 0.1}, set(), done))
    committed = []
    with (
        ManifestWriter(tmp_path / "m.jsonl") as man,
        sw.ShardWriter(tmp_path, 4, man, threads=3, on_commit=committed.append) as w,
    ):
        for idx in (2, 0, 1, 3):
            w.submit(idx, f"p{idx}", [1, 2, 3], [], [0, 1, 1])
    assert done != [2, 0, 1, 3]  # the writes really finished out of submission order
    assert [r["idx"] for r in committed] == [2, 0, 1, 3]
    text = (tmp_path / "m.jsonl").read_text()
    assert (
        text.splitlines()[0]
        == '{"idx": 2, "id": "p2", "num_tokens": 3, "num_loss_tokens": 2, "xxh3_128": "sha-2"}'
    )
    assert [r for r in read_manifest(tmp_path / "m.jsonl").rows] == [2, 0, 1, 3]


def test_writer_error_stops_the_manifest_at_the_failed_sample(tmp_path, monkeypatch):
    done: list[int] = []
    monkeypatch.setattr(sw, "_write_one", _fake_write({1: 0.2}, {1}, done))
    with pytest.raises(UserError, match="data_1.pt: disk full"):
        with (
            ManifestWriter(tmp_path / "m.jsonl") as man,
            sw.ShardWriter(tmp_path, 4, man, threads=2) as w,
        ):
            for idx in range(6):
                w.submit(idx, f"p{idx}", [1, 2], [], [1, 1])
                time.sleep(0.05)
    rows = list(read_manifest(tmp_path / "m.jsonl").rows)
    assert rows == [
        0
    ]  # 0 landed before the failure; nothing after 1 is logged (shards would be adopted on resume)


def test_writer_bounds_pending_tokens(tmp_path, monkeypatch):
    peak = [0]
    active = [0]
    lock = threading.Lock()

    def write(
        root, idx, rows_per_dir, input_ids, states, loss_mask, storage=None, checksum="xxh3_128"
    ):
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        time.sleep(0.05)
        with lock:
            active[0] -= 1
        return "x"

    monkeypatch.setattr(sw, "_write_one", write)
    with (
        ManifestWriter(tmp_path / "m.jsonl") as man,
        sw.ShardWriter(tmp_path, 4, man, threads=8, max_pending_tokens=25) as w,
    ):
        for idx in range(12):
            w.submit(
                idx, "p", [0] * 10, [], [1] * 10
            )  # 10 tokens each: at most 2 pending at a time
            assert w._pending_tokens <= 25
    assert peak[0] <= 2
    assert len(read_manifest(tmp_path / "m.jsonl").rows) == 12


@pytest.mark.parametrize("make", [_llama, _deepseek], ids=["llama", "deepseek_v3"])
def test_hooked_states_are_exactly_output_hidden_states(make):
    """The decoder hooks keep 4 states instead of N+1; they must be the very same values."""
    from eagle3.capture.hf import HFCapture

    model = make()
    hooked = HFCapture(model, [1, 3, 4], batch_tokens=10_000)
    got = hooked.capture(SAMPLES)
    assert hooked._hooks_ok is True
    full = HFCapture(model, [1, 3, 4], batch_tokens=10_000)
    full._hooks_ok = False  # force output_hidden_states
    want = full.capture(SAMPLES)
    for a, b in zip(got, want):
        for x, y in zip(a, b):
            assert x.dtype == torch.bfloat16 and torch.equal(x, y)
    # and they are hidden_states[i] of the padded forward (index i = input of decoder layer i)
    ids = torch.tensor([SAMPLES[0]])
    with torch.no_grad():
        ref = model(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states
    for k, layer in enumerate([1, 3, 4, 6]):
        torch.testing.assert_close(
            got[0][k].float(), ref[layer][0].to(torch.bfloat16).float(), atol=5e-4, rtol=8e-3
        )


def test_capture_async_views_equal_capture():
    from eagle3.capture.hf import HFCapture

    cap = HFCapture(_llama(), [1, 3, 4], batch_tokens=12)  # several forwards
    pending = cap.capture_async(SAMPLES)
    assert pending.ready()  # CPU: nothing in flight
    views = pending.result()
    owned = cap.capture(SAMPLES)
    for a, b, s in zip(views, owned, SAMPLES):
        for x, y in zip(a, b):
            assert x.shape == (len(s), 64) and torch.equal(x, y)
            assert y.untyped_storage().nbytes() == len(s) * 64 * 2


@pytest.mark.parametrize("via_path", [False, True], ids=["streamed", "by_path"])
def test_atomic_torch_save_is_the_bytesio_archive_and_hashes_it(tmp_path, via_path):
    """Shards streamed through a file object (hashed on the way) or saved by path by torch's C++
    writer (read back for the hash; stage 02's default): the bytes must be exactly those of
    ``torch.save`` into a BytesIO (the old writer), whatever the destination's name."""
    import hashlib
    import io

    from eagle3.io import atomic_torch_save
    from eagle3.shards.write import write_sample

    torch.manual_seed(0)
    hs = [torch.randn(37, 64).to(torch.bfloat16) for _ in range(4)]
    obj = {
        "input_ids": torch.arange(37),
        "hidden_states": hs,
        "loss_mask": torch.ones(37, dtype=torch.int64),
    }
    buf = io.BytesIO()
    torch.save(obj, buf)
    for name in ("a.pt", "data_12.pt", "x"):
        h = hashlib.sha256()
        atomic_torch_save(obj, tmp_path / name, hasher=h, via_path=via_path)
        data = (tmp_path / name).read_bytes()
        assert data == buf.getvalue(), name
        assert h.hexdigest() == hashlib.sha256(data).hexdigest()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "a.pt",
        "data_12.pt",
        "x",
    ]  # no temp file left
    # write_sample of views into a larger (pinned-style) batch buffer: same file as exact-size tensors
    big = torch.randn(4, 100, 64).to(torch.bfloat16)
    views = [big[k, 10:47] for k in range(4)]
    p1 = write_sample(tmp_path / "v", 3, 4, list(range(37)), views, [1] * 37)
    p2 = write_sample(tmp_path / "c", 3, 4, list(range(37)), [v.clone() for v in views], [1] * 37)
    assert p1.read_bytes() == p2.read_bytes() and p1.stat().st_size < 37 * 64 * 2 * 4 + 4096


def test_writer_threads_lower_the_switch_interval_and_restore_it(tmp_path):
    """While writer threads run, the GIL switch interval is at most ``SWITCH_INTERVAL_S``; it is
    restored on close, also when the block fails; the serial writer leaves it alone."""
    import sys

    old = sys.getswitchinterval()
    with (
        ManifestWriter(tmp_path / "a.jsonl") as man,
        sw.ShardWriter(tmp_path / "a", 4, man, threads=0),
    ):
        assert sys.getswitchinterval() == old
    with (
        ManifestWriter(tmp_path / "b.jsonl") as man,
        sw.ShardWriter(tmp_path / "b", 4, man, threads=2),
    ):
        assert sys.getswitchinterval() == min(old, sw.SWITCH_INTERVAL_S) == 0.0005
    assert sys.getswitchinterval() == old
    with pytest.raises(KeyError):
        with (
            ManifestWriter(tmp_path / "c.jsonl") as man,
            sw.ShardWriter(tmp_path / "c", 4, man, threads=2),
        ):
            raise KeyError("upstream")
    assert sys.getswitchinterval() == old
