"""Stage 02's check that ``prompts.jsonl`` was made under the config's ``prompts:`` settings
(``eagle3.capture.extract.check_prompts_current``): the report is read once, and the source file named by
``prompts.source`` is hashed only when its size or mtime changed since 01 recorded its hash."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest
import yaml

import eagle3.prompts.prepare_prompts as pp
from eagle3.capture.extract import check_prompts_current
from eagle3.config import load_config
from eagle3.errors import UserError


def _cfg(tmp_path: Path, *sets: str):
    src = tmp_path / "source.jsonl"
    if not src.exists():
        src.write_text(json.dumps({"id": "a", "messages": [{"role": "user", "content": "hi"},
                                                            {"role": "assistant", "content": "hello"}]}) + "\n")
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"run_name": "t", "output_root": str(tmp_path / "out"),
                                    "verifier": {"path": str(tmp_path / "verifier")},
                                    "prompts": {"source": str(src), "format": "auto"}}))
    cfg = load_config(path, list(sets))
    cfg.prompts_path.parent.mkdir(parents=True, exist_ok=True)
    cfg.prompts_path.write_text("{}\n")
    return cfg, src


def test_refusal_reads_the_report_once(tmp_path, monkeypatch):
    cfg, _ = _cfg(tmp_path)
    rep = pp.report_path(cfg)
    rep.write_text(json.dumps({"settings": {**pp.settings(cfg, None), "seed": 3}, "cli_overrides": ["format"]}))
    opened = []
    real_open = io.open

    def counting_open(file, *a, **k):
        if isinstance(file, (str, os.PathLike)) and Path(file) == rep:
            opened.append(file)
        return real_open(file, *a, **k)

    monkeypatch.setattr(io, "open", counting_open)
    with pytest.raises(UserError) as e:
        check_prompts_current(cfg)
    assert str(e.value) == (f"{rep}: prompts.jsonl was made with other prompts settings than this config's (changed "
                            "seed: 3 -> 0); re-run 01_prepare_prompts.py with this config first (it was run with "
                            "--format on its command line: give it again, or put it in the config)")
    assert len(opened) == 1  # the comparison and the hint read the same content (it was read twice)
