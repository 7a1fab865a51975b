"""Loss mask from turn-prefix rendering: hand-written expectations for ChatML and Kimi templates."""

from __future__ import annotations

import hashlib

import pytest
from _chat_single import TemplateNotPrefixStable, tokenize_conversation
from kimi_tokenizer import KIMI_CHAT_TEMPLATE, KimiStyleTokenizer

from eagle3.chat.template import (
    chat_template_hash,
    end_of_turn_ids,
    render,
)
from eagle3.errors import UserError

TWO_TURNS = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4"},
]

# SmolLM2 (ChatML) rendering of TWO_TURNS, token by token, with the expected loss mask.
# Header "<|im_start|>assistant\n" -> 0; reply + "<|im_end|>" -> 1; the "\n" after <|im_end|> -> 0
# (generation stops at <|im_end|>, so the verifier never emits it).
SMOL_EXPECTED = [
    (1, "<|im_start|>", 0),
    (9690, "system", 0),
    (198, "Ċ", 0),
    (6077, "Be", 0),
    (5453, "Ġbrief", 0),
    (30, ".", 0),
    (2, "<|im_end|>", 0),
    (198, "Ċ", 0),
    (1, "<|im_start|>", 0),
    (4093, "user", 0),
    (198, "Ċ", 0),
    (26843, "Hi", 0),
    (2, "<|im_end|>", 0),
    (198, "Ċ", 0),
    (1, "<|im_start|>", 0),
    (520, "ass", 0),
    (9531, "istant", 0),
    (198, "Ċ", 0),
    (19556, "Hello", 1),
    (17, "!", 1),
    (2, "<|im_end|>", 1),
    (198, "Ċ", 0),
    (1, "<|im_start|>", 0),
    (4093, "user", 0),
    (198, "Ċ", 0),
    (34, "2", 0),
    (27, "+", 0),
    (34, "2", 0),
    (47, "?", 0),
    (2, "<|im_end|>", 0),
    (198, "Ċ", 0),
    (1, "<|im_start|>", 0),
    (520, "ass", 0),
    (9531, "istant", 0),
    (198, "Ċ", 0),
    (36, "4", 1),
    (2, "<|im_end|>", 1),
    (198, "Ċ", 0),
]


def test_chatml_two_turns_hand_written_mask(smollm_tokenizer):
    ids, mask = tokenize_conversation(smollm_tokenizer, TWO_TURNS, max_length=512)
    assert ids == [t for t, _, _ in SMOL_EXPECTED]
    assert smollm_tokenizer.convert_ids_to_tokens(ids) == [s for _, s, _ in SMOL_EXPECTED]
    assert mask == [m for _, _, m in SMOL_EXPECTED]


def test_render_matches_apply_chat_template(smollm_tokenizer):
    text = smollm_tokenizer.apply_chat_template(
        TWO_TURNS[:2], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>assistant\n")
    assert (
        render(smollm_tokenizer, TWO_TURNS[:2], add_generation_prompt=True)
        == smollm_tokenizer(text, add_special_tokens=False)["input_ids"]
    )


def test_truncate_and_skip(smollm_tokenizer):
    full_ids = [t for t, _, _ in SMOL_EXPECTED]
    full_mask = [m for _, _, m in SMOL_EXPECTED]
    # cut inside the first reply: after "Hello" (index 18) -> 19 tokens, one masked
    ids, mask = tokenize_conversation(smollm_tokenizer, TWO_TURNS, max_length=19)
    assert ids == full_ids[:19] and mask == full_mask[:19] and sum(mask) == 1
    assert (
        tokenize_conversation(smollm_tokenizer, TWO_TURNS, max_length=19, too_long="skip") is None
    )
    # exactly fitting is not "too long"
    assert tokenize_conversation(
        smollm_tokenizer, TWO_TURNS, max_length=len(full_ids), too_long="skip"
    ) == (full_ids, full_mask)
    # truncated before any reply token: nothing to learn -> skipped
    assert tokenize_conversation(smollm_tokenizer, TWO_TURNS, max_length=18) is None


def test_prompt_only_conversation_is_skipped(smollm_tokenizer):
    assert tokenize_conversation(smollm_tokenizer, TWO_TURNS[:2], max_length=512) is None


def test_kimi_style_slow_tokenizer_hand_written_mask():
    tok = KimiStyleTokenizer()
    assert not tok.is_fast  # like Kimi's tiktoken tokenizer: no fast backend, no offsets
    msgs = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "ok?"},
        {"role": "assistant", "content": "sure"},
    ]
    ids, mask = tokenize_conversation(tok, msgs, max_length=100)

    def chars(s, m):
        return [(c, m) for c in s]

    expected = (
        [("<|im_system|>", 0), ("system", 0), ("<|im_middle|>", 0)]
        + chars("You are Kimi.", 0)
        + [("<|im_end|>", 0)]
        + [
            ("<|im_user|>", 0),
            ("user", 0),
            ("<|im_middle|>", 0),
            ("h", 0),
            ("i", 0),
            ("<|im_end|>", 0),
        ]
        + [
            ("<|im_assistant|>", 0),
            ("assistant", 0),
            ("<|im_middle|>", 0),
            ("y", 1),
            ("o", 1),
            ("<|im_end|>", 1),
        ]
        + [("<|im_user|>", 0), ("user", 0), ("<|im_middle|>", 0)]
        + chars("ok?", 0)
        + [("<|im_end|>", 0)]
        + [("<|im_assistant|>", 0), ("assistant", 0), ("<|im_middle|>", 0)]
        + chars("sure", 1)
        + [("<|im_end|>", 1)]
    )
    assert tok.convert_ids_to_tokens(ids) == [t for t, _ in expected]
    assert mask == [m for _, m in expected]
    assert sum(mask) == 3 + 5


def test_end_of_turn_ids():
    tok = KimiStyleTokenizer()
    assert end_of_turn_ids(tok) == {
        tok.convert_tokens_to_ids("[EOS]"),
        tok.convert_tokens_to_ids("<|im_end|>"),
    }


def test_template_without_end_token_masks_whole_span():
    # "A: ...\n\n" has no end-of-turn special token: the span runs to the next header, "\n\n" included
    tok = KimiStyleTokenizer()
    tpl = (
        r"{% for m in messages %}{{ 'Q: ' if m['role'] == 'user' else 'A: ' }}{{ m['content'] + '\n\n' }}"
        r"{% endfor %}{% if add_generation_prompt %}{{ 'A: ' }}{% endif %}"
    )
    msgs = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    ids, mask = tokenize_conversation(tok, msgs, max_length=100, chat_template=tpl)
    assert tok.convert_ids_to_tokens(ids) == [
        "Q",
        ":",
        " ",
        "x",
        "\n",
        "\n",
        "A",
        ":",
        " ",
        "y",
        "\n",
        "\n",
    ]
    assert mask == [0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1]


def test_not_prefix_stable_template_raises():
    # the header counts the messages, so rendering a prefix changes the first tokens
    tok = KimiStyleTokenizer()
    tpl = (
        "{{ messages|length }}{%- for m in messages -%}<|im_user|>{{ m['content'] }}<|im_end|>{%- endfor -%}"
        "{%- if add_generation_prompt -%}<|im_assistant|>{%- endif -%}"
    )
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    with pytest.raises(TemplateNotPrefixStable, match="not prefix-stable"):
        tokenize_conversation(tok, msgs, max_length=100, chat_template=tpl)


def test_chat_template_hash():
    tok = KimiStyleTokenizer()
    assert chat_template_hash(tok) == hashlib.sha256(KIMI_CHAT_TEMPLATE.encode()).hexdigest()
    assert chat_template_hash(tok, "{{ x }}") == hashlib.sha256(b"{{ x }}").hexdigest()
    tok.chat_template = None
    with pytest.raises(UserError, match="chat_template"):
        chat_template_hash(tok)


def test_unstable_boundary_falls_back_to_turn_segments(smollm_tokenizer):
    """A reply starting with a newline merges with the header's newline under joint BPE; the mask
    must still cover exactly the reply + <|im_end|>, tokenized as a server would produce them."""
    tok = smollm_tokenizer
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "\n\nHello there"}]
    head = render(tok, msgs[:1], add_generation_prompt=True)
    ids, mask = tokenize_conversation(tok, msgs, max_length=512)
    reply = tok("\n\nHello there", add_special_tokens=False)["input_ids"]
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    # header tokens unchanged, then the reply tokenized on its own, then <|im_end|>, then "\n"
    assert ids[: len(head)] == head
    assert ids[len(head) : len(head) + len(reply)] == reply
    assert ids[len(head) + len(reply)] == im_end
    assert mask == [0] * len(head) + [1] * (len(reply) + 1) + [0] * (
        len(ids) - len(head) - len(reply) - 1
    )


def test_regenerated_reply_tokens_are_used_verbatim(smollm_tokenizer):
    """24 single "\\n" tokens generated by the verifier re-tokenize as 2 multi-newline tokens; the
    shard must hold what the verifier generated, not the re-tokenization."""
    tok = smollm_tokenizer
    nl = tok("\n", add_special_tokens=False)["input_ids"]
    assert len(nl) == 1
    gen = nl * 24
    text = tok.decode(gen)
    assert len(tok(text, add_special_tokens=False)["input_ids"]) < 24  # the round trip is lossy
    msgs = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": text, "tokens": gen},
    ]
    head = render(tok, msgs[:1], add_generation_prompt=True)
    ids, mask = tokenize_conversation(tok, msgs, max_length=512)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert ids == head + gen + [im_end] + nl
    assert mask == [0] * len(head) + [1] * 25 + [0]


@pytest.mark.parametrize("with_tokens", [True, False])
def test_truncated_answer_has_no_loss_on_the_appended_end_of_turn(smollm_tokenizer, with_tokens):
    """An answer 01 cut at ``prompts.max_new_tokens`` (``truncated: true``) gets the template's ``<|im_end|>``
    appended by the rendering, but the verifier never emitted it: mask 0 there (and on the "\\n" after it), the
    generated tokens keep mask 1, and the next turn follows as before. The same conversation with the answer
    finished (no key, as in files from before it) keeps the end-of-turn token in the loss. With ``tokens`` (local
    or SGLang regeneration) and without (OpenAI endpoint, text only)."""
    tok = smollm_tokenizer
    msgs = [dict(m) for m in TWO_TURNS]
    if with_tokens:
        msgs[2]["tokens"], msgs[4]["tokens"] = (
            [19556, 17],
            [36],
        )  # "Hello", "!" / "4", as the verifier generated
    finished_ids, finished_mask = tokenize_conversation(tok, msgs, max_length=512)
    assert finished_ids == [t for t, _, _ in SMOL_EXPECTED] and finished_mask == [
        m for _, _, m in SMOL_EXPECTED
    ]
    msgs[2]["truncated"] = True
    ids, mask = tokenize_conversation(tok, msgs, max_length=512)
    # token for token: the same ids; the first reply's <|im_end|> (position 20) leaves the loss, nothing else moves
    expected = [(t, s, 0 if i == 20 else m) for i, (t, s, m) in enumerate(SMOL_EXPECTED)]
    assert SMOL_EXPECTED[20][:2] == (2, "<|im_end|>") and SMOL_EXPECTED[18][1:] == ("Hello", 1)
    assert ids == [t for t, _, _ in expected]
    assert mask == [m for _, _, m in expected]
    assert mask[18:22] == [1, 1, 0, 0] and mask[-3:] == [
        1,
        1,
        0,
    ]  # "Hello" "!" <|im_end|> "\n"; "4" <|im_end|> "\n"
    # both answers cut: only their generated tokens are loss tokens
    msgs[4]["truncated"] = True
    ids, mask = tokenize_conversation(tok, msgs, max_length=512)
    assert ids == [t for t, _, _ in SMOL_EXPECTED]
    assert [s for (_, s, _), m in zip(SMOL_EXPECTED, mask) if m] == ["Hello", "!", "4"]
    # the key is 01's own: the template never sees it (the rendering is the same with and without it)
    assert render(tok, msgs) == render(tok, TWO_TURNS)


@pytest.mark.parametrize("with_tokens", [True, False])
def test_answer_stopped_on_another_stop_id_has_no_loss_on_the_template_end_of_turn(
    smollm_tokenizer, with_tokens
):
    """An answer the verifier stopped on ``<|endoftext|>`` (id 0, in SmolLM2's stop set) is rendered with the
    template's ``<|im_end|>`` (id 2) after it, which the verifier did not emit there: ``stop_token: 0`` takes it (and
    the "\n" after it) out of the loss, as ``truncated: true`` does; ``stop_token: 2`` (the template's own) and no
    key (files from before it) keep it in. The ids never change and the next turn follows as before."""
    tok = smollm_tokenizer
    assert {0, 2} <= end_of_turn_ids(tok) and tok.convert_ids_to_tokens([0, 2]) == [
        "<|endoftext|>",
        "<|im_end|>",
    ]
    msgs = [dict(m) for m in TWO_TURNS]
    if with_tokens:
        msgs[2]["tokens"], msgs[4]["tokens"] = [19556, 17], [36]
    want_ids = [t for t, _, _ in SMOL_EXPECTED]
    msgs[2]["stop_token"] = (
        2  # stopped on the template's own end-of-turn: as a message without the key
    )
    assert tokenize_conversation(tok, msgs, max_length=512) == (
        want_ids,
        [m for _, _, m in SMOL_EXPECTED],
    )
    msgs[2]["stop_token"] = (
        0  # stopped on <|endoftext|>: position 20 (<|im_end|>) leaves the loss, nothing else moves
    )
    ids, mask = tokenize_conversation(tok, msgs, max_length=512)
    assert ids == want_ids
    assert mask == [0 if i == 20 else m for i, (_, _, m) in enumerate(SMOL_EXPECTED)]
    assert mask[18:22] == [1, 1, 0, 0] and mask[-3:] == [1, 1, 0]
    assert render(tok, msgs) == render(
        tok, TWO_TURNS
    )  # the key is 01's own: never passed to the template
