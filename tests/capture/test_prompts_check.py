"""Stage 02's check that ``prompts.jsonl`` was made under the config's ``prompts:`` settings
(``eagle3.stages.prompts_manifest.require_current``): the report is read once, and the source file named by
``prompts.source`` is hashed only when its size or mtime changed since 01 recorded its hash."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest
import yaml

import eagle3.regen.manifest as manifest
import eagle3.stages.prepare_prompts as pp
import eagle3.stages.prompts_manifest as stage_manifest
from eagle3.config import load_config
from eagle3.errors import UserError


def _cfg(tmp_path: Path, *sets: str):
    src = tmp_path / "source.jsonl"
    if not src.exists():
        src.write_text(
            json.dumps(
                {
                    "id": "a",
                    "messages": [
                        {"role": "user", "content": "hi"},
                        {"role": "assistant", "content": "hello"},
                    ],
                }
            )
            + "\n"
        )
    path = tmp_path / "run.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "run_name": "t",
                "output_root": str(tmp_path / "out"),
                "verifier": {"path": str(tmp_path / "verifier")},
                "prompts": {"source": str(src), "format": "auto"},
            }
        )
    )
    cfg = load_config(path, list(sets))
    cfg.prompts_path.parent.mkdir(parents=True, exist_ok=True)
    cfg.prompts_path.write_text("{}\n")
    return cfg, src


def test_refusal_reads_the_report_once(tmp_path, monkeypatch):
    cfg, _ = _cfg(tmp_path)
    rep = stage_manifest.report_path(cfg)
    rep.write_text(
        json.dumps(
            {
                "settings": {**stage_manifest.settings(cfg, None), "dedupe": False},
                "cli_overrides": ["format"],
            }
        )
    )
    opened = []
    real_open = io.open

    def counting_open(file, *a, **k):
        if isinstance(file, (str, os.PathLike)) and Path(file) == rep:
            opened.append(file)
        return real_open(file, *a, **k)

    monkeypatch.setattr(io, "open", counting_open)
    with pytest.raises(UserError) as e:
        stage_manifest.require_current(cfg)
    assert str(e.value) == (
        f"{rep}: prompts.dedupe False -> True; re-run 01_prepare_prompts.py with this config first (it was "
        "run with --format on its command line: give it again, or put it in the config)"
    )
    assert len(opened) == 1  # the comparison and the hint read the same content (it was read twice)


def test_source_hash_reused_while_size_and_mtime_hold(tmp_path, monkeypatch):
    """01 records the source's size, mtime_ns and sha256 (prompts_report.json ``source_stats``); 02's check reuses
    the hash while size and mtime are those, and hashes the file again after a change."""
    cfg, src = _cfg(tmp_path)
    pp.run(cfg)  # 01 on a file source (no regeneration)
    st = os.stat(src)
    rep = json.loads(stage_manifest.report_path(cfg).read_text())
    assert rep["source_stats"] == {
        str(src.resolve()): {
            "bytes": st.st_size,
            "mtime_ns": st.st_mtime_ns,
            "sha256": rep["settings"]["sha256"],
        }
    }
    hashed = []
    real = manifest.file_sha256
    monkeypatch.setattr(manifest, "file_sha256", lambda p: hashed.append(Path(p)) or real(p))
    stage_manifest.require_current(cfg)
    assert hashed == []  # unchanged: the recorded hash is used
    old_sha = rep["settings"]["sha256"]

    text = src.read_text()
    src.write_text(text.replace("hello", "howdy"))  # same size, other bytes
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    with pytest.raises(UserError) as e:
        stage_manifest.require_current(cfg)
    assert hashed == [src]  # hashed again: the content change is seen
    assert real(src) != old_sha and f": the content of {src} changed; re-run" in str(e.value)

    hashed.clear()
    src.write_text(text)  # the original bytes back, a new mtime: hashed again, nothing to refuse
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 2 * 10**9))
    stage_manifest.require_current(cfg)
    assert hashed == [src]


def test_an_edited_source_file_is_named_not_its_fingerprints(tmp_path):
    """A source file edited since 01 (or a changed list of them): 02's refusal said ``changed bytes: 223 -> 311; sha256:
    '05e8...' -> 'e310...'`` and, for a list, printed both lists of fingerprints (about 600 characters); 01's
    ``remaking`` line did the same for a list. Both now say which file changed, or how the names changed."""
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    for f, text in ((a, "hi"), (b, "yo")):
        f.write_text(
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": text},
                        {"role": "assistant", "content": "ok"},
                    ]
                }
            )
            + "\n"
        )
    cfg, src = _cfg(tmp_path, f"prompts.source=[{a}, {b}]")
    rep = stage_manifest.report_path(cfg)
    rep.write_text(
        json.dumps({"settings": stage_manifest.settings(cfg, None), "cli_overrides": []})
    )
    a.write_text(a.read_text() * 2)
    want = stage_manifest.settings(cfg, None)
    with pytest.raises(UserError) as e:
        stage_manifest.require_current(cfg)
    assert str(e.value) == (
        f"{rep}: the content of {a} changed; re-run 01_prepare_prompts.py with this config first"
    )
    report = json.loads(rep.read_text())
    assert (
        manifest.redo_reason(cfg.prompts_path, rep, report, want)
        == f"settings changed: the content of {a} changed"
    )
    one, _ = _cfg(tmp_path, f"prompts.source={a}", "prompts.sample_size=4", "prompts.seed=4")
    assert manifest.redo_reason(
        cfg.prompts_path, rep, report, stage_manifest.settings(one, None)
    ) == (
        f"settings changed: prompts.source {[str(a), str(b)]!r} -> {str(a)!r}; "
        "prompts.sample_size None -> 4"
    )
    with pytest.raises(UserError, match=rf": prompts\.source \[.*\] -> '{a}'; re-run 01"):
        stage_manifest.require_current(one)
    # one source file: its content, then another seed beside it
    rep.write_text(
        json.dumps({"settings": stage_manifest.settings(one, None), "cli_overrides": []})
    )
    a.write_text(a.read_text() * 2)
    five = _cfg(tmp_path, f"prompts.source={a}", "prompts.sample_size=4", "prompts.seed=5")[0]
    with pytest.raises(UserError) as e:
        stage_manifest.require_current(five)
    assert f": the content of {a} changed; re-run" in str(e.value)  # the first difference
    assert manifest.redo_reason(
        five.prompts_path, rep, json.loads(rep.read_text()), stage_manifest.settings(five, None)
    ) == (f"settings changed: the content of {a} changed; prompts.seed 4 -> 5")
