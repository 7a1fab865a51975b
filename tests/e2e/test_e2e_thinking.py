"""A thinking-mode multi-turn dataset with tool calls, 01 -> 05 on the tiny verifier, each stage a process.

The verifier is tests/conftest.py's random 6-layer Llama (SmolLM2 tokenizer) with the Kimi-K2.5-style
thinking template of tests/prompts/test_chat_templates.py and ``chat_template_kwargs: {thinking: true}``.
Every assistant turn carries reasoning, so the history of later turns (empty think blocks) differs
from what was served and each turn becomes its own sample; the masks are checked against the
text the verifier generated, spelled out here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from test_chat_templates import KIMI_K25_STYLE

from eagle3.shards.data_config import read_data_config
from eagle3.shards.format import list_samples
from eagle3.shards.manifest import read_manifest
from eagle3.shards.read import load_sample

ROOT = Path(__file__).resolve().parents[2]
TOPICS = ["sea", "moon", "tree", "rain", "snow", "wind"]


def _dataset() -> list[dict]:
    rows = []
    for i, t in enumerate(TOPICS):
        rows.append(
            {
                "id": f"c{i}",
                "messages": [
                    {"role": "user", "content": f"Name a colour of the {t}."},
                    {
                        "role": "assistant",
                        "reasoning_content": f"The {t} is often blue.",
                        "content": f"Blue, like the {t}.",
                    },
                    {"role": "user", "content": "And another?"},
                    # inline think block: 01 splits it into reasoning_content
                    {"role": "assistant", "content": f"<think>Grey fits the {t} too.</think>Grey."},
                ],
            }
        )
    call = {
        "id": "functions.get:0",
        "type": "function",
        "function": {"name": "get", "arguments": "{}"},
    }
    rows.append(
        {
            "id": "tool",
            "tools": [{"type": "function", "function": {"name": "get"}}],
            "messages": [
                {"role": "user", "content": "Weather?"},
                {
                    "role": "assistant",
                    "reasoning_content": "Look it up.",
                    "content": "",
                    "tool_calls": [call],
                },
                {"role": "tool", "tool_call_id": "functions.get:0", "content": "sunny"},
                {"role": "assistant", "reasoning_content": "Report it.", "content": "It is sunny."},
            ],
        }
    )
    return rows


def _expected_masked() -> dict[str, str]:
    """Sample id -> the text of its loss-masked tokens (what the verifier generated)."""
    out = {}
    for i, t in enumerate(TOPICS):
        out[f"c{i}#turn1"] = f"The {t} is often blue.</think>Blue, like the {t}.<|im_end|>"
        out[f"c{i}#turn2"] = f"Grey fits the {t} too.</think>Grey.<|im_end|>"
    out["tool"] = (
        "Look it up.</think><|tool_calls_section_begin|><|tool_call_begin|>functions.get:0"
        "<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|><|im_end|>"
        "Report it.</think>It is sunny.<|im_end|>"
    )
    return out


@pytest.mark.slow
def test_thinking_multiturn_dataset_end_to_end(tiny_llama_dir, smollm_tokenizer, tmp_path):
    src = tmp_path / "thinking.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in _dataset()))
    cfg = yaml.safe_load((ROOT / "configs/tiny-llama.yaml").read_text())
    out = tmp_path / "run"
    cfg["output_root"] = str(out)
    cfg["verifier"].update(
        path=str(tiny_llama_dir),
        chat_template=KIMI_K25_STYLE,
        chat_template_kwargs={"thinking": True},
    )
    cfg["prompts"] = {"source": str(src), "format": "messages", "regenerate": False}
    cfg["train"].update(epochs=1, log_every=2)
    cfg["benchmark"].update(num_prompts=2, max_new_tokens=8)
    cfg_path = tmp_path / "thinking.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    for script in (
        "01_prepare_prompts.py",
        "02_extract_hidden.py",
        "03_prepare_data.py",
        "04_train.py",
        "05_benchmark.py",
    ):
        r = subprocess.run(
            [sys.executable, str(ROOT / script), "--config", str(cfg_path)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert r.returncode == 0, f"{script} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"

    # 01 kept reasoning (inline think blocks split off) and the tool turns
    rows = {r["id"]: r for r in map(json.loads, (out / "prompts.jsonl").read_text().splitlines())}
    assert rows["c0"]["messages"][3] == {
        "role": "assistant",
        "content": "Grey.",
        "reasoning_content": "Grey fits the sea too.",
    }
    assert [m["role"] for m in rows["tool"]["messages"]] == [
        "user",
        "assistant",
        "tool",
        "assistant",
    ]
    assert rows["tool"]["tools"] == [{"type": "function", "function": {"name": "get"}}]

    # 02: one sample per served context, ids {id}#turn{n}, masks = generated text only
    meta = read_data_config(out / "shards")
    assert meta["chat_template_kwargs"] == {"thinking": True}
    assert meta["split"] == {"conversations": len(TOPICS), "samples": 2 * len(TOPICS)}
    man = read_manifest(out / "shards" / "manifest.jsonl").rows
    expected = _expected_masked()
    assert sorted(r["id"] for r in man.values()) == sorted(expected)
    for idx, path in list_samples(out / "shards"):
        s = load_sample(path)
        ids, mask = s["input_ids"].tolist(), s["loss_mask"].tolist()
        sid = man[idx]["id"]
        assert smollm_tokenizer.decode([t for t, m in zip(ids, mask) if m]) == expected[sid], sid
        unmasked = smollm_tokenizer.decode([t for t, m in zip(ids, mask) if not m])
        assert unmasked.endswith("<|im_assistant|>assistant<|im_middle|><think>"), (
            sid
        )  # header never masked
        if sid.endswith(
            "#turn2"
        ):  # history as the server rendered it: turn 1 with an empty think block
            assert "<think></think>Blue, like the" in unmasked and "is often blue" not in unmasked
        if sid == "tool":
            assert "## Return of functions.get:0\nsunny" in unmasked

    # 03 -> 05 ran on these shards
    assert (out / "data" / "vocab_map.pt").is_file()
    assert (out / "drafter-sglang" / "config.json").is_file()
    assert "tau" in (out / "bench" / "bench.json").read_text()
