"""Reasoning and tool turns through 01 (normalisation) and 02 (per-turn samples, ids, metadata, resume)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import yaml
from test_chat_templates import KIMI_K25_STYLE

from eagle3.capture.prompts import read_prompts
from eagle3.config import load_config
from eagle3.data.readers import read_conversations
from eagle3.errors import UserError
from eagle3.shards.data_config import read_data_config
from eagle3.shards.format import list_samples
from eagle3.shards.manifest import read_manifest
from eagle3.shards.read import load_sample
from eagle3.stages.extract import fingerprint, run, tokenize_prompts

CALL = {"id": "functions.get:0", "type": "function", "function": {"name": "get", "arguments": "{}"}}


def _jsonl(path: Path, rows) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_messages_keep_reasoning_and_tool_turns(tmp_path):
    rows = [
        {
            "id": "t1",
            "tools": [{"type": "function", "function": {"name": "get"}}],
            "messages": [
                {"role": "user", "content": "w?"},
                {
                    "role": "assistant",
                    "content": None,
                    "reasoning_content": " Look. ",
                    "tool_calls": [CALL],
                },
                {"role": "tool", "tool_call_id": "functions.get:0", "content": "5"},
                {"role": "assistant", "content": "<think>\nSo.\n</think>\n\nIt is 5."},
                {"role": "user", "content": "thanks"},
            ],
        },
        {
            "id": "t2",
            "messages": [
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": "a", "reasoning": "r"},
            ],
        },
        # a tool result nobody asked for, and one after a plain answer: not a served order
        {
            "id": "bad1",
            "messages": [
                {"role": "user", "content": "q"},
                {"role": "tool", "content": "x"},
                {"role": "assistant", "content": "a"},
            ],
        },
        {
            "id": "bad2",
            "messages": [
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": "a"},
                {"role": "tool", "content": "x"},
            ],
        },
        # an answered tool call whose final answer is missing: the dangling result is dropped
        {
            "id": "t3",
            "messages": [
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": "", "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "functions.get:0", "content": "x"},
            ],
        },
    ]
    counts = Counter()
    got = read_conversations(_jsonl(tmp_path / "m.jsonl", rows), counts=counts)
    assert got == [
        {
            "id": "t1",
            "tools": rows[0]["tools"],
            "messages": [
                {"role": "user", "content": "w?"},
                {
                    "role": "assistant",
                    "content": "",
                    "reasoning_content": "Look.",
                    "tool_calls": [CALL],
                },
                {"role": "tool", "content": "5", "tool_call_id": "functions.get:0"},
                {"role": "assistant", "content": "It is 5.", "reasoning_content": "So."},
            ],
        },
        {
            "id": "t2",
            "messages": [
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": "a", "reasoning_content": "r"},
            ],
        },
        {
            "id": "t3",
            "messages": [
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": "", "tool_calls": [CALL]},
            ],
        },
    ]
    assert counts["skipped_non_alternating"] == 2 and counts["inline_reasoning_split"] == 1


def test_chat_template_kwargs_reserved_names_are_refused(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text(
        yaml.safe_dump(
            {
                "run_name": "x",
                "verifier": {"path": "v", "chat_template_kwargs": {"tools": []}},
                "prompts": {"source": "humaneval"},
            }
        )
    )
    with pytest.raises(UserError, match="verifier.chat_template_kwargs"):
        load_config(p)


def _cfg(tmp_path: Path, verifier_dir, kwargs=None, **extract):
    raw = {
        "run_name": "t",
        "output_root": str(tmp_path / "out"),
        "verifier": {
            "path": str(verifier_dir),
            "name": "tiny",
            "dtype": "float32",
            "device": "cpu",
            "chat_template": KIMI_K25_STYLE,
            **({"chat_template_kwargs": kwargs} if kwargs else {}),
        },
        "prompts": {"source": "humaneval"},
        "extract": {
            "aux_layers": [1, 3, 4],
            "max_length": 400,
            "batch_tokens": 10**6,
            "rows_per_dir": 2,
            **extract,
        },
    }
    p = tmp_path / "run.yaml"
    p.write_text(yaml.safe_dump(raw))
    return load_config(p)


THINKING_ROWS = [
    {
        "id": "c1",
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "reasoning_content": "Greet back.", "content": "Hello!"},
            {"role": "user", "content": "Bye"},
            {"role": "assistant", "reasoning_content": "Say bye.", "content": "Bye!"},
        ],
    },
    {
        "id": "c2",
        "messages": [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "reasoning_content": "Add.", "content": "4"},
        ],
    },
    {
        "id": "c3",
        "messages": [
            {"role": "user", "content": "x"},
            {"role": "assistant", "reasoning_content": "r", "content": "y"},
        ],
    },
]


def test_fingerprint_records_template_kwargs_and_keeps_old_folders(tmp_path):
    plain = _cfg(tmp_path, "v")
    _, comp = fingerprint(plain, "sha")
    # fields at their defaults are left out, so shards extracted before they existed still resume
    assert (
        "chat_template_kwargs" not in comp["verifier"]
        and "loss_on_reasoning" not in comp["extract"]
    )
    fp_on, comp_on = fingerprint(_cfg(tmp_path, "v", {"thinking": True}), "sha")
    assert comp_on["verifier"]["chat_template_kwargs"] == {"thinking": True}
    assert fp_on != fingerprint(_cfg(tmp_path, "v", {"thinking": False}), "sha")[0]
    assert (
        fingerprint(_cfg(tmp_path, "v", loss_on_reasoning=False), "sha")[1]["extract"][
            "loss_on_reasoning"
        ]
        is False
    )


@pytest.fixture(scope="module")
def tiny_backend(tiny_llama_dir):
    from eagle3.capture.hf import HFCapture
    from eagle3.config import VerifierConfig
    from eagle3.verifier.load import load_verifier

    model, tok = load_verifier(
        VerifierConfig(path=str(tiny_llama_dir), name="tiny", dtype="float32", device="cpu")
    )
    return HFCapture(model, [1, 3, 4], batch_tokens=10**9), tok


def test_thinking_dataset_split_ids_metadata_and_resume(tmp_path, tiny_llama_dir, tiny_backend):
    cap, tok = tiny_backend
    cfg = _cfg(tmp_path, tiny_llama_dir, {"thinking": True})
    rows = THINKING_ROWS[:2]
    _jsonl(cfg.prompts_path, rows)
    prompts = read_prompts(cfg.prompts_path)
    samples, counts, skipped = tokenize_prompts(tok, prompts, cfg, cfg.prompts_path)
    assert [(s.idx, s.id) for s in samples] == [(0, "c1#turn1"), (1, "c1#turn2"), (2, "c2")]
    assert counts["split_conversations"] == 1 and counts["split_samples"] == 2 and skipped == {}
    masked = [tok.decode([t for t, m in zip(s.input_ids, s.loss_mask) if m]) for s in samples]
    assert masked == [
        "Greet back.</think>Hello!<|im_end|>",
        "Say bye.</think>Bye!<|im_end|>",
        "Add.</think>4<|im_end|>",
    ]
    # the second sample's context holds turn 1 as the server rendered it then (empty think block)
    assert (
        "<|im_middle|><think></think>Hello!<|im_end|><|im_user|>user<|im_middle|>Bye"
        in tok.decode(samples[1].input_ids)
    )

    summary = run(cfg, backend=cap, tokenizer=tok)
    assert summary["samples"] == 3 and summary["split_conversations"] == 1
    meta = read_data_config(cfg.shards_dir)
    assert meta["chat_template_kwargs"] == {"thinking": True} and meta["loss_on_reasoning"] is True
    assert meta["split"] == {"conversations": 1, "samples": 2}
    man = read_manifest(cfg.shards_dir / "manifest.jsonl").rows
    assert [man[i]["id"] for i in range(3)] == ["c1#turn1", "c1#turn2", "c2"]
    # resume: a lost shard is redone in place, the others untouched
    first = {i: p.stat().st_mtime_ns for i, p in list_samples(cfg.shards_dir)}
    lost = dict(list_samples(cfg.shards_dir))[1]
    lost.unlink()
    assert run(cfg, backend=cap, tokenizer=tok)["resumed"] == 2
    again = dict(list_samples(cfg.shards_dir))
    assert load_sample(again[1])["loss_mask"].tolist() == samples[1].loss_mask
    assert again[0].stat().st_mtime_ns == first[0]
    # the same folder with thinking off is another extraction: refused, naming the changed key and both values
    with pytest.raises(
        UserError,
        match=r"changed verifier\.chat_template_kwargs: \{'thinking': True\} -> \{'thinking': False\}",
    ):
        run(_cfg(tmp_path, tiny_llama_dir, {"thinking": False}), backend=cap, tokenizer=tok)


def test_inconsistent_conversation_is_skipped_with_its_id(
    tmp_path, tiny_llama_dir, smollm_tokenizer
):
    cfg = _cfg(tmp_path, tiny_llama_dir, {"thinking": False})
    # reasoning in a thinking-off run cannot have been served that way: skipped, listed, not fatal
    _jsonl(
        cfg.prompts_path,
        THINKING_ROWS[1:]
        + [
            {
                "id": "plain",
                "messages": [
                    {"role": "user", "content": "q"},
                    {"role": "assistant", "content": "a"},
                ],
            }
        ],
    )
    samples, counts, skipped = tokenize_prompts(
        smollm_tokenizer, read_prompts(cfg.prompts_path), cfg, cfg.prompts_path
    )
    assert [s.id for s in samples] == ["plain"]
    assert counts["skipped_inconsistent"] == 2
    assert skipped == {"inconsistent:reasoning_not_rendered": ["c2", "c3"]}


def test_regenerate_renders_thinking_prompts_and_keeps_tool_conversations(tiny_backend):
    """In-process regeneration answers the server's prompt (kwargs reach the template: the prompt
    ends with <think>, so the reply is all reasoning until a </think>), and returns conversations
    with tool calls unchanged (their tool results answer the original calls)."""
    from eagle3.chat.template import ChatOptions, prompt_ids
    from eagle3.regen.regenerate import regenerate

    cap, tok = tiny_backend
    tool_conv = {
        "id": "t",
        "tools": [{"type": "function", "function": {"name": "get"}}],
        "messages": [
            {"role": "user", "content": "w?"},
            {"role": "assistant", "content": "", "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "functions.get:0", "content": "5"},
            {"role": "assistant", "content": "5."},
        ],
    }
    plain = {"id": "p", "messages": [{"role": "user", "content": "Hi"}]}
    opts = ChatOptions(chat_template=KIMI_K25_STYLE, template_kwargs={"thinking": True})
    stats = {}
    out = regenerate(cap.model, tok, [tool_conv, plain], 4, 2, stats=stats, opts=opts)
    assert out[0] == tool_conv and stats["kept_with_tools"] == 1 and stats["answers"] == 1
    head = prompt_ids(tok, plain["messages"], opts)
    assert tok.decode(head).endswith("<|im_assistant|>assistant<|im_middle|><think>")
    reply = out[1]["messages"][1]
    assert (
        reply["tokens"]
        and reply["reasoning_content"] == tok.decode(reply["tokens"]).split("</think>")[0].strip()
    )


def test_every_conversation_failing_to_render_is_fatal(tmp_path, smollm_tokenizer):
    cfg = _cfg(tmp_path, "v")
    cfg.verifier.chat_template = "{{ raise_exception('template broken') }}"
    _jsonl(cfg.prompts_path, THINKING_ROWS)
    with pytest.raises(
        UserError,
        match=r"every conversation failed to render; the first: .*prompts.jsonl:1: "
        r"conversation 'c1' skipped: render_failed: .*template broken",
    ):
        tokenize_prompts(smollm_tokenizer, read_prompts(cfg.prompts_path), cfg, cfg.prompts_path)


def test_stage02_stops_on_a_template_ignoring_generation_prompt(tmp_path, smollm_tokenizer):
    from test_chat_templates import BROKEN_CHATML

    cfg = _cfg(tmp_path, "v")
    cfg.verifier.chat_template = BROKEN_CHATML
    _jsonl(
        cfg.prompts_path,
        [
            {
                "id": "p",
                "messages": [
                    {"role": "user", "content": "q"},
                    {"role": "assistant", "content": "a"},
                ],
            }
        ],
    )
    with pytest.raises(
        UserError,
        match=r"prompts.jsonl:1: verifier.chat_template: verifier.chat_template \(from the "
        r"config\), sha256 [0-9a-f]{12} ignores add_generation_prompt",
    ):
        tokenize_prompts(smollm_tokenizer, read_prompts(cfg.prompts_path), cfg, cfg.prompts_path)
    cfg.verifier.reply_start = "<|im_start|>assistant\n"
    samples, _, _ = tokenize_prompts(
        smollm_tokenizer, read_prompts(cfg.prompts_path), cfg, cfg.prompts_path
    )
    masked = smollm_tokenizer.decode(
        [t for t, m in zip(samples[0].input_ids, samples[0].loss_mask) if m]
    )
    assert masked == "a<|im_end|>"
