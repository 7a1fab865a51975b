"""Stage 02 across several patched SGLang servers (eagle3.capture.multi) against local stand-ins.

The stand-ins are tests/capture/test_capture_sglang.py's (SGLang 0.5.23's endpoints, capture files written
by the patch's own code), each with its own capture folder. One of them fails mid-run (HTTP 500, or
the connection dropped and nothing listening any more); every sample must still be captured exactly
once and the shard folder must be byte-for-byte the one a single server gives.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_capture_sglang import StandIn, ec, serve  # ec: patches/eagle3_capture.py
from test_extract import _config

from eagle3.capture.multi import MultiServerCapture, sglang_backend
from eagle3.capture.sglang import SGLangCapture
from eagle3.config import load_config
from eagle3.errors import UserError
from eagle3.io import read_json
from eagle3.shards.format import list_samples
from eagle3.shards.manifest import read_manifest
from eagle3.stages.extract import run

AUX = [3, 31, 59]


def standin_servers(tmp_path, monkeypatch, n: int):
    """``n`` stand-in servers, each with its own capture folder (a generator for fixtures: started, yielded,
    stopped)."""
    monkeypatch.setenv(ec.ENV_DIR, str(tmp_path))
    monkeypatch.setitem(ec._STATE, "layers", None)
    out, httpds = [], []
    for k in range(n):
        cap = tmp_path / f"capture{k}"
        cap.mkdir()
        st = StandIn(cap)
        st.start_model()
        httpds.append(serve(st))
        out.append(st)
    yield out
    for h in httpds:
        h.shutdown()
        h.server_close()


@pytest.fixture()
def servers(tmp_path, monkeypatch):
    """Three stand-in servers, each with its own capture folder (started; stopped at the end)."""
    yield from standin_servers(tmp_path, monkeypatch, 3)


def _one(st, **kw) -> SGLangCapture:
    return SGLangCapture(url=st.url, capture_dir=st.capture_dir, aux_layers=AUX, timeout=30, **kw)


def _multi(sts, **kw) -> MultiServerCapture:
    return MultiServerCapture([_one(s) for s in sts], backoff_s=0.0, **kw)


def _cfg(tmp_path: Path, name: str, model_dir: Path):
    # batch_tokens 40: about one sample per batch, so several batches reach every server
    return load_config(
        _config(
            tmp_path / name,
            model_dir,
            backend="sglang",
            aux_layers=AUX,
            batch_tokens=40,
            disk_margin_bytes=0,
        )
    )


def _folder(root: Path, ignore: tuple[str, ...] = ()) -> dict[str, bytes]:
    """Every stage-02 file's bytes by relative path, minus what names the run (paths, timings, the disk plan)
    and the data_config.json keys in ``ignore``."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.name not in (
            ".extract.lock",
            "extract_state.json",
            "extract_report.json",
            "extract_report.md",
            "data_config.json",
        ):
            out[str(p.relative_to(root))] = p.read_bytes()
    dc = read_json(root / "data_config.json")
    for key in ("prompts_file", *ignore):
        dc.pop(key)
    out["data_config.json"] = repr(sorted(dc.items())).encode()
    return out


@pytest.fixture()
def reference(tmp_path, servers, tiny_llama_dir, smollm_tokenizer) -> Path:
    """The shards folder of an uninterrupted run on one server."""
    cfg = _cfg(tmp_path, "ref", tiny_llama_dir)
    s = run(cfg, backend=_one(servers[2]), tokenizer=smollm_tokenizer)
    assert s["samples"] == 6
    return cfg.shards_dir


def _check_exactly_once(root: Path, sts) -> None:
    man = read_manifest(root / "manifest.jsonl").rows
    assert sorted(man) == [i for i, _ in list_samples(root)] == list(range(6))
    for st in sts:  # every capture file was read and deleted
        assert [p.name for p in st.capture_dir.iterdir()] == [ec.INFO_FILE]


@pytest.mark.parametrize("mode", ["500", "refuse"])
def test_failing_server_mid_run_same_shards_as_one_server(
    tmp_path, servers, reference, tiny_llama_dir, smollm_tokenizer, mode
):
    a, b = servers[0], servers[1]
    b.fail_after, b.fail_mode = 1, mode  # b answers one batch, then fails every request
    cfg = _cfg(tmp_path, "multi", tiny_llama_dir)
    be = _multi([a, b], per_server=1, max_failures=2)
    s = run(cfg, backend=be, tokenizer=smollm_tokenizer)
    assert s["written"] == 6
    _check_exactly_once(cfg.shards_dir, [a, b])
    assert _folder(cfg.shards_dir) == _folder(reference)
    by = {sv["url"]: sv for sv in s["servers"]}
    assert (
        by[b.url]["batches"] == 1 and by[b.url]["failed_attempts"] >= 1
    )  # its failed batches went to a
    assert by[a.url]["batches"] == len(a.posts) >= 3
    if by[b.url]["failed_attempts"] >= 2:
        assert by[b.url]["taken_out_of_rotation"] == 1
    captured = [
        tuple(ids) for post in a.posts + b.posts[:1] for ids in post["input_ids"]
    ]  # the answered posts
    assert len(captured) == len(set(captured)) == 6  # each sample captured once


def test_batches_spread_over_servers(
    tmp_path, servers, reference, tiny_llama_dir, smollm_tokenizer
):
    cfg = _cfg(tmp_path, "spread", tiny_llama_dir)
    s = run(cfg, backend=_multi(servers[:2], per_server=1), tokenizer=smollm_tokenizer)
    assert _folder(cfg.shards_dir) == _folder(reference)
    assert all(sv["batches"] >= 1 for sv in s["servers"])  # both servers worked
    assert sum(sv["batches"] for sv in s["servers"]) == len(servers[0].posts) + len(
        servers[1].posts
    )


def test_every_server_failing_stops_then_resume_matches(
    tmp_path, servers, reference, tiny_llama_dir, smollm_tokenizer
):
    a, b = servers[0], servers[1]
    a.fail_after, b.fail_after = 1, 1
    cfg = _cfg(tmp_path, "down", tiny_llama_dir)
    with pytest.raises(
        UserError,
        match=r"^extract\.sglang_url: every capture server failed 2 batches in a row .*"
        r"HTTP 500: .*re-run the same command to resume",
    ):
        run(cfg, backend=_multi([a, b], per_server=1, max_failures=2), tokenizer=smollm_tokenizer)
    kept = read_manifest(cfg.shards_dir / "manifest.jsonl").rows
    assert 1 <= len(kept) <= 2 and not (cfg.shards_dir / "data_config.json").exists()
    a.fail_after = b.fail_after = None  # servers fixed: the same command resumes
    s = run(cfg, backend=_multi([a, b], per_server=1), tokenizer=smollm_tokenizer)
    assert s["resumed"] == len(kept) and s["written"] == 6 - len(kept)
    _check_exactly_once(cfg.shards_dir, [a, b])
    assert _folder(cfg.shards_dir) == _folder(reference)


def test_servers_must_agree(servers):
    servers[1].layers = [2, 30, 58]
    servers[1].start_model()
    with pytest.raises(
        UserError,
        match=rf"{servers[1].capture_dir}/capture_info.json: the server captures HF layers",
    ):
        _multi(servers[:2]).info()
    servers[1].layers = AUX
    servers[1].start_model()
    servers[1].arch = "LlamaForCausalLM"
    with pytest.raises(
        UserError,
        match=rf"^extract\.sglang_url {servers[1].url}: serves .*LlamaForCausalLM.* but "
        rf"{servers[0].url} serves .*DeepseekV3ForCausalLM.*same verifier",
    ):
        _multi(servers[:2]).info()


def test_sglang_backend_from_config_values(tmp_path, servers):
    a, b = servers[0], servers[1]
    kw = dict(timeout=5, max_length=None, max_requests=None)
    assert isinstance(sglang_backend(a.url, str(a.capture_dir), AUX, **kw), SGLangCapture)
    multi = sglang_backend(
        [a.url, b.url], [str(a.capture_dir), str(b.capture_dir)], AUX, per_server=3, **kw
    )
    assert isinstance(multi, MultiServerCapture) and multi.pool.capacity == 6
    assert [s.capture_dir for s in multi.servers] == [a.capture_dir, b.capture_dir]
    with pytest.raises(
        UserError,
        match=r"^extract\.capture_dir: 2 servers in extract\.sglang_url need 2 capture folders",
    ):
        sglang_backend([a.url, b.url], str(a.capture_dir), AUX, **kw)
    with pytest.raises(UserError, match="duplicate URL"):
        sglang_backend([a.url, a.url + "/"], [str(a.capture_dir), str(b.capture_dir)], AUX, **kw)
    with pytest.raises(
        UserError,
        match=r"need 2 capture folders .* each server needs its own capture folder\), got \['",
    ):
        sglang_backend([a.url, b.url], [str(a.capture_dir)] * 2, AUX, **kw)
    cfg = load_config(
        _config(
            tmp_path / "c",
            tmp_path,
            backend="sglang",
            sglang_url=[a.url, b.url],
            capture_dir=[str(a.capture_dir), str(b.capture_dir)],
        )
    )
    assert cfg.extract.sglang_url == [a.url, b.url] and cfg.extract.server_max_failures == 3
    with pytest.raises(
        UserError, match=r"extract\.sglang_url.*expected http://host:port, got 'node2:30000'"
    ):
        load_config(
            _config(tmp_path / "d", tmp_path, backend="sglang", sglang_url=[a.url, "node2:30000"])
        )


def test_cli_several_servers_one_failing(tmp_path, servers, reference, tiny_llama_dir, capsys):
    """02_extract_hidden.py --server A B --capture-dir DA DB, B answering HTTP 500 after one batch."""
    import importlib
    import json
    import re
    import shutil
    import sys

    from eagle3.cli import run_main

    # the tiny verifier's tokenizer with a 61-layer config, so aux layers [3, 31, 59] are valid
    vdir = tmp_path / "verifier"
    shutil.copytree(tiny_llama_dir, vdir)
    conf = json.loads((vdir / "config.json").read_text())
    (vdir / "config.json").write_text(json.dumps({**conf, "num_hidden_layers": 61}))
    a, b = servers[0], servers[1]
    b.fail_after = 1
    cfg_path = _config(
        tmp_path / "cli",
        vdir,
        backend="sglang",
        aux_layers=AUX,
        batch_tokens=40,
        disk_margin_bytes=0,
    )
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    cli = importlib.import_module("02_extract_hidden")
    with pytest.raises(SystemExit) as e:
        run_main(
            cli.main,
            [
                "--config",
                str(cfg_path),
                "--server",
                a.url,
                b.url,
                "--capture-dir",
                str(a.capture_dir),
                str(b.capture_dir),
            ],
        )
    out = capsys.readouterr().out
    assert e.value.code == 0, out
    assert re.search(rf"^server {b.url}: 1 batches, [1-9]\d* failed attempts, ", out, re.M), out
    assert re.search(
        rf"^server {a.url}: 5 batches, 0 failed attempts, out of rotation 0 times$", out, re.M
    ), out
    root = load_config(cfg_path).shards_dir
    _check_exactly_once(root, [a, b])
    # the verifier folder (part of the fingerprint) is another copy here; everything else is the same
    assert _folder(root, ignore=("config_fingerprint",)) == _folder(
        reference, ignore=("config_fingerprint",)
    )
