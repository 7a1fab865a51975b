"""Loss masks of thinking-mode, Qwen3-style, tool-call and broken templates, spelled out by hand.

The tokenizer is the Kimi-style slow stand-in (tests/prompts/kimi_tokenizer.py): specials (incl. ``<think>``,
``</think>``, the tool-call markers and ``<|im_start|>``) are single tokens, ``system``/``user``/
``assistant`` are word tokens, everything else one token per character, so every expected sample is
written token by token with its mask bit.

KIMI_K25_STYLE mirrors the structure of Kimi-K2.5's ``chat_template.jinja`` as documented publicly
(hist/suffix split at the last assistant turn without tool calls: every such finished turn and
everything before it renders ``<think></think>``, later turns, i.e. an unfinished tool-call chain,
keep ``<think>{reasoning_content}</think>``; ``thinking=false`` empties all of them; the generation
prompt ends with ``<think>``, or ``<think></think>`` with ``thinking=false``; tool results render as
``## Return of {id}``). It is written here in our own words, not copied.
"""

from __future__ import annotations

import json

import pytest
from _chat_single import TemplateNotPrefixStable, tokenize_conversation
from kimi_tokenizer import KimiStyleTokenizer

from eagle3.chat.samples import conversation_samples
from eagle3.chat.template import (
    ChatOptions,
    TemplateIgnoresGenerationPrompt,
    check_template,
    generation_prompt,
    split_reasoning,
)

KIMI_K25_STYLE = (
    "{%- set ns = namespace(last_final=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'assistant' and not m.get('tool_calls') -%}"
    "{%- set ns.last_final = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- if tools -%}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>{%- endif -%}"
    "{%- if not messages or messages[0]['role'] != 'system' -%}"
    "<|im_system|>system<|im_middle|>You are Kimi.<|im_end|>{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'user' -%}<|im_user|>user<|im_middle|>{{ m['content'] }}"
    "{%- elif m['role'] == 'assistant' -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if loop.index0 <= ns.last_final or (thinking is defined and thinking is false) -%}<think></think>"
    "{%- else -%}<think>{{ m.get('reasoning_content') or '' }}</think>{%- endif -%}"
    "{{ m['content'] }}"
    "{%- if m.get('tool_calls') -%}<|tool_calls_section_begin|>"
    "{%- for tc in m['tool_calls'] -%}<|tool_call_begin|>{{ tc['id'] }}<|tool_call_argument_begin|>"
    "{{ tc['function']['arguments'] }}<|tool_call_end|>{%- endfor -%}<|tool_calls_section_end|>{%- endif -%}"
    "{%- elif m['role'] == 'tool' -%}<|im_system|>tool<|im_middle|>## Return of {{ m['tool_call_id'] }}"
    "{{ '\\n' }}{{ m['content'] }}"
    "{%- else -%}<|im_system|>system<|im_middle|>{{ m['content'] }}{%- endif -%}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if thinking is defined and thinking is false -%}<think></think>{%- else -%}<think>{%- endif -%}"
    "{%- endif -%}"
)

# Qwen3-style: ChatML; an assistant turn after the last user message renders its think block
# (the last one always, empty or not), earlier ones render the answer only; enable_thinking=false
# puts an empty think block into the generation prompt.
QWEN3_STYLE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}"
    "{%- set r = m.get('reasoning_content') or '' -%}"
    "{%- if loop.index0 > ns.last_user and (loop.last or r) -%}"
    "{{ '<|im_start|>assistant\\n<think>\\n' + r.strip('\\n') + '\\n</think>\\n\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- else -%}{{ '<|im_start|>assistant\\n' + m['content'] + '<|im_end|>\\n' }}{%- endif -%}"
    "{%- else -%}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif -%}"
    "{%- endif -%}"
)

# ChatML that forgets the generation prompt: add_generation_prompt changes nothing.
BROKEN_CHATML = "{%- for m in messages -%}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endfor -%}"

# ChatML with a generation prompt but no tool-call rendering (drops tool_calls silently).
CHATML_NO_TOOLS = (
    BROKEN_CHATML + "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)

TWO_TURNS_REASONING = [
    {"role": "user", "content": "hi"},
    {"role": "assistant", "reasoning_content": "Hmm.", "content": "yo"},
    {"role": "user", "content": "ok?"},
    {"role": "assistant", "reasoning_content": "Sure?", "content": "fine"},
]


def C(text: str, m: int) -> list:
    """One (token, mask) per character (the stand-in tokenizer's non-word text)."""
    return [(c, m) for c in text]


def T(*toks: str, m: int) -> list:
    return [(t, m) for t in toks]


K_SYS = (
    T("<|im_system|>", "system", "<|im_middle|>", m=0)
    + C("You are Kimi.", 0)
    + T("<|im_end|>", m=0)
)
K_HEAD = T("<|im_assistant|>", "assistant", "<|im_middle|>", m=0)


def k_user(x):
    return T("<|im_user|>", "user", "<|im_middle|>", m=0) + C(x, 0) + T("<|im_end|>", m=0)


Q_HEAD = T("<|im_start|>", "assistant", m=0) + C("\n", 0)


def q_user(x):
    return T("<|im_start|>", "user", m=0) + C("\n", 0) + C(x, 0) + T("<|im_end|>", m=0) + C("\n", 0)


def q_think(r: str, m: int) -> list:
    return T("<think>", m=m) + C("\n" + r + "\n", m) + T("</think>", m=m) + C("\n\n", m)


@pytest.fixture
def tok():
    return KimiStyleTokenizer()


def _check(tok, sample, expected):
    assert tok.convert_ids_to_tokens(sample.input_ids) == [t for t, _ in expected]
    assert sample.loss_mask == [m for _, m in expected]


def _samples(tok, msgs, tpl, max_length=1000, tools=None, **kw):
    return conversation_samples(
        tok, msgs, max_length, ChatOptions(chat_template=tpl, **kw), tools=tools
    )


# ---------------------------------------------------------------------------------------------
# Kimi-K2.5 style, thinking mode
# ---------------------------------------------------------------------------------------------
def test_kimi_thinking_two_turns_one_sample_per_turn(tok):
    res = _samples(tok, TWO_TURNS_REASONING, KIMI_K25_STYLE, template_kwargs={"thinking": True})
    assert res.skip_reason is None
    assert [s.suffix for s in res.samples] == ["#turn1", "#turn2"]
    assert res.counts["split_conversations"] == 1 and res.counts["split_samples"] == 2
    # turn 1 as served: the prompt ends with <think>; the verifier generated "Hmm.</think>yo<|im_end|>"
    _check(
        tok,
        res.samples[0],
        K_SYS
        + k_user("hi")
        + K_HEAD
        + T("<think>", m=0)
        + C("Hmm.", 1)
        + T("</think>", m=1)
        + C("yo", 1)
        + T("<|im_end|>", m=1),
    )
    # turn 2: the history holds turn 1 with an EMPTY think block (as the server rendered it), all mask 0
    _check(
        tok,
        res.samples[1],
        K_SYS
        + k_user("hi")
        + K_HEAD
        + T("<think>", "</think>", m=0)
        + C("yo", 0)
        + T("<|im_end|>", m=0)
        + k_user("ok?")
        + K_HEAD
        + T("<think>", m=0)
        + C("Sure?", 1)
        + T("</think>", m=1)
        + C("fine", 1)
        + T("<|im_end|>", m=1),
    )
    with pytest.raises(TemplateNotPrefixStable, match="not prefix-stable"):
        tokenize_conversation(
            tok, TWO_TURNS_REASONING, 1000, opts=ChatOptions(KIMI_K25_STYLE, {"thinking": True})
        )


def test_kimi_thinking_without_reasoning_loss(tok):
    res = _samples(
        tok,
        TWO_TURNS_REASONING[:2],
        KIMI_K25_STYLE,
        template_kwargs={"thinking": True},
        loss_on_reasoning=False,
    )
    assert [s.suffix for s in res.samples] == [""]
    _check(
        tok,
        res.samples[0],
        K_SYS
        + k_user("hi")
        + K_HEAD
        + T("<think>", m=0)
        + C("Hmm.", 0)
        + T("</think>", m=0)
        + C("yo", 1)
        + T("<|im_end|>", m=1),
    )


def test_kimi_thinking_empty_history_reasoning_stays_one_sample(tok):
    """A first answer with no reasoning renders the same in history: turns nest, one sample."""
    msgs = [dict(m) for m in TWO_TURNS_REASONING]
    del msgs[1]["reasoning_content"]
    res = _samples(tok, msgs, KIMI_K25_STYLE, template_kwargs={"thinking": True})
    assert [s.suffix for s in res.samples] == [""] and not res.counts["split_conversations"]
    _check(
        tok,
        res.samples[0],
        K_SYS
        + k_user("hi")
        + K_HEAD
        + T("<think>", m=0)
        + T("</think>", m=1)
        + C("yo", 1)
        + T("<|im_end|>", m=1)
        + k_user("ok?")
        + K_HEAD
        + T("<think>", m=0)
        + C("Sure?", 1)
        + T("</think>", m=1)
        + C("fine", 1)
        + T("<|im_end|>", m=1),
    )


def test_kimi_thinking_off_kwargs_reach_the_template(tok):
    msgs = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in TWO_TURNS_REASONING]
    res = _samples(tok, msgs, KIMI_K25_STYLE, template_kwargs={"thinking": False})
    assert [s.suffix for s in res.samples] == [""]
    _check(
        tok,
        res.samples[0],
        K_SYS
        + k_user("hi")
        + K_HEAD
        + T("<think>", "</think>", m=0)
        + C("yo", 1)
        + T("<|im_end|>", m=1)
        + k_user("ok?")
        + K_HEAD
        + T("<think>", "</think>", m=0)
        + C("fine", 1)
        + T("<|im_end|>", m=1),
    )
    # reasoning in a thinking-off run cannot have been served: skipped with a reason, not fatal
    bad = _samples(tok, TWO_TURNS_REASONING, KIMI_K25_STYLE, template_kwargs={"thinking": False})
    assert bad.samples == [] and bad.skip_reason == "inconsistent:reasoning_not_rendered"
    assert bad.counts["skipped_inconsistent"] == 1


def test_kimi_tool_call_chain_masks_calls_not_results(tok):
    call = {
        "id": "functions.get:0",
        "type": "function",
        "function": {"name": "get", "arguments": '{"c":1}'},
    }
    tools = [{"type": "function", "function": {"name": "get"}}]
    msgs = [
        {"role": "user", "content": "w?"},
        {"role": "assistant", "reasoning_content": "Look.", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "functions.get:0", "content": "5"},
        {"role": "assistant", "reasoning_content": "So.", "content": "It is 5."},
    ]
    res = _samples(tok, msgs, KIMI_K25_STYLE, tools=tools, template_kwargs={"thinking": True})
    assert res.skip_reason is None and [s.suffix for s in res.samples] == [""]
    decl = (
        T("<|im_system|>", m=0)
        + C("tool_declare", 0)
        + T("<|im_middle|>", m=0)
        + C(json.dumps(tools), 0)
        + T("<|im_end|>", m=0)
    )
    _check(
        tok,
        res.samples[0],
        decl
        + K_SYS
        + k_user("w?")
        + K_HEAD
        + T("<think>", m=0)
        + C("Look.", 1)
        + T("</think>", "<|tool_calls_section_begin|>", "<|tool_call_begin|>", m=1)
        + C("functions.get:0", 1)
        + T("<|tool_call_argument_begin|>", m=1)
        + C('{"c":1}', 1)
        + T("<|tool_call_end|>", "<|tool_calls_section_end|>", "<|im_end|>", m=1)
        + T("<|im_system|>", m=0)
        + C("tool", 0)
        + T("<|im_middle|>", m=0)
        + C("## Return of functions.get:0\n5", 0)
        + T("<|im_end|>", m=0)
        + K_HEAD
        + T("<think>", m=0)
        + C("So.", 1)
        + T("</think>", m=1)
        + C("It is 5.", 1)
        + T("<|im_end|>", m=1),
    )


def test_tool_calls_the_template_drops_skip_the_conversation(tok):
    call = {"id": "c1", "type": "function", "function": {"name": "get", "arguments": "{}"}}
    msgs = [
        {"role": "user", "content": "w?"},
        {"role": "assistant", "content": "x", "tool_calls": [call]},
    ]
    res = _samples(tok, msgs, CHATML_NO_TOOLS)
    assert res.samples == [] and res.skip_reason == "inconsistent:tool_calls_not_rendered"


def test_generated_tokens_used_verbatim_with_reasoning(tok):
    """``tokens`` from regeneration are kept as generated (here "user" spelled as 4 characters, which
    re-tokenizing would merge into one word token); the reasoning part ends at </think>."""
    ids = tok.convert_tokens_to_ids(["H", "m", "</think>", "u", "s", "e", "r"])
    msgs = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "reasoning_content": "Hm", "content": "user", "tokens": ids},
    ]
    res = _samples(
        tok, msgs, KIMI_K25_STYLE, template_kwargs={"thinking": True}, loss_on_reasoning=False
    )
    _check(
        tok,
        res.samples[0],
        K_SYS
        + k_user("hi")
        + K_HEAD
        + T("<think>", m=0)
        + C("Hm", 0)
        + T("</think>", m=0)
        + C("user", 1)
        + T("<|im_end|>", m=1),
    )


# ---------------------------------------------------------------------------------------------
# Qwen3 style
# ---------------------------------------------------------------------------------------------
def test_qwen3_thinking_two_turns(tok):
    res = _samples(tok, TWO_TURNS_REASONING, QWEN3_STYLE)
    assert [s.suffix for s in res.samples] == ["#turn1", "#turn2"]
    # the model writes "<think>\n...\n</think>\n\n" itself after "<|im_start|>assistant\n"; "\n" after <|im_end|> is 0
    _check(
        tok,
        res.samples[0],
        q_user("hi") + Q_HEAD + q_think("Hmm.", 1) + C("yo", 1) + T("<|im_end|>", m=1) + C("\n", 0),
    )
    _check(
        tok,
        res.samples[1],
        q_user("hi")
        + Q_HEAD
        + C("yo", 0)
        + T("<|im_end|>", m=0)
        + C("\n", 0)
        + q_user("ok?")
        + Q_HEAD
        + q_think("Sure?", 1)
        + C("fine", 1)
        + T("<|im_end|>", m=1)
        + C("\n", 0),
    )
    off = _samples(tok, TWO_TURNS_REASONING[:2], QWEN3_STYLE, loss_on_reasoning=False)
    _check(
        tok,
        off.samples[0],
        q_user("hi")
        + Q_HEAD
        + q_think("Hmm.", 0)[:-2]
        + C("\n\n", 1)
        + C("yo", 1)
        + T("<|im_end|>", m=1)
        + C("\n", 0),
    )


def test_qwen3_thinking_off_history_differs_so_split(tok):
    msgs = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in TWO_TURNS_REASONING]
    res = _samples(tok, msgs, QWEN3_STYLE, template_kwargs={"enable_thinking": False})
    assert [s.suffix for s in res.samples] == ["#turn1", "#turn2"]
    empty = (
        T("<think>", m=0) + C("\n\n", 0) + T("</think>", m=0) + C("\n\n", 0)
    )  # part of the prompt
    _check(
        tok,
        res.samples[0],
        q_user("hi") + Q_HEAD + empty + C("yo", 1) + T("<|im_end|>", m=1) + C("\n", 0),
    )
    _check(
        tok,
        res.samples[1],
        q_user("hi")
        + Q_HEAD
        + C("yo", 0)
        + T("<|im_end|>", m=0)
        + C("\n", 0)
        + q_user("ok?")
        + Q_HEAD
        + empty
        + C("fine", 1)
        + T("<|im_end|>", m=1)
        + C("\n", 0),
    )


# ---------------------------------------------------------------------------------------------
# templates that ignore add_generation_prompt
# ---------------------------------------------------------------------------------------------
def test_template_ignoring_generation_prompt_is_refused(tok):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    with pytest.raises(
        TemplateIgnoresGenerationPrompt,
        match=r"verifier.chat_template \(from the config\), sha256 "
        r"[0-9a-f]{12} ignores add_generation_prompt.*verifier.reply_start",
    ):
        _samples(tok, msgs, BROKEN_CHATML)
    # the tokenizer's own template is named by the tokenizer
    tok.chat_template = BROKEN_CHATML
    with pytest.raises(TemplateIgnoresGenerationPrompt, match="chat template of tokenizer"):
        check_template(tok, ChatOptions())


def test_reply_start_fixes_a_template_ignoring_generation_prompt(tok):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    opts = ChatOptions(chat_template=BROKEN_CHATML, reply_start="<|im_start|>assistant\n")
    assert (
        generation_prompt(tok, msgs[:1], opts)
        == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    res = conversation_samples(tok, msgs, 100, opts)
    _check(
        tok, res.samples[0], q_user("hi") + Q_HEAD + C("yo", 1) + T("<|im_end|>", m=1) + C("\n", 0)
    )


def test_split_reasoning():
    assert split_reasoning("<think>\nA\n</think>\n\nB") == ("A", "B")
    assert split_reasoning("A</think>B", opened=True) == ("A", "B")
    assert split_reasoning("no think") == (None, "no think")
    assert split_reasoning("<think>cut off") == ("cut off", "")


def test_template_raising_on_one_conversation_skips_it(tok):
    tpl = (
        "{%- if messages[0]['content'] == 'boom' -%}{{ raise_exception('no boom here') }}{%- endif -%}"
        + CHATML_NO_TOOLS
    )
    ok = _samples(
        tok, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], tpl
    )
    assert len(ok.samples) == 1 and ok.skip_reason is None
    bad = _samples(
        tok, [{"role": "user", "content": "boom"}, {"role": "assistant", "content": "yo"}], tpl
    )
    assert bad.samples == [] and bad.counts["skipped_render_failed"] == 1
    assert bad.skip_reason.startswith("render_failed") and "no boom here" in bad.skip_reason


def test_qwen3_thinking_2507_prompt_opens_think(tok):
    """Qwen3-*-Thinking-2507 templates end the generation prompt with "<think>\n": the verifier
    writes only "reasoning\n</think>\n\nanswer", and the reasoning is still recognised as such."""
    tpl = QWEN3_STYLE.replace(
        "{{ '<|im_start|>assistant\\n' }}{%- if enable_thinking",
        "{{ '<|im_start|>assistant\\n<think>\\n' }}{%- if enable_thinking",
    )
    assert generation_prompt(tok, TWO_TURNS_REASONING[:1], ChatOptions(tpl)).endswith(
        "assistant\n<think>\n"
    )
    res = _samples(tok, TWO_TURNS_REASONING[:2], tpl, loss_on_reasoning=False)
    _check(
        tok,
        res.samples[0],
        q_user("hi")
        + Q_HEAD
        + T("<think>", m=0)
        + C("\n", 0)
        + C("Hmm.\n", 0)
        + T("</think>", m=0)
        + C("\n\nyo", 1)
        + T("<|im_end|>", m=1)
        + C("\n", 0),
    )
