"""A tiny Kimi-style SLOW tokenizer for tests (no tokenizer.json, no offset mapping).

Kimi-K2/K2.5 ship a tiktoken-based remote-code tokenizer: a ``PreTrainedTokenizer`` (not fast), so
``return_offsets_mapping`` is unavailable, and a chat template built from the specials
``<|im_system|> <|im_user|> <|im_assistant|> <|im_middle|> <|im_end|>`` (FIELD-NOTES section 6).
This stand-in reproduces exactly those properties with a readable vocabulary: the specials, three
whole-word tokens (``system``, ``user``, ``assistant``, as Kimi's BPE has them) and one token per
printable ASCII character, matched greedily longest-first; plus the reasoning and tool-call markers
(``<think>``, ``</think>``, ``<|tool_call_begin|>``...) and ChatML's ``<|im_start|>`` as single
tokens, so Kimi thinking-mode and Qwen3-style templates can be tested with masks spelled by hand.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizer

KIMI_SPECIALS = [
    "[BOS]",
    "[EOS]",
    "<|im_end|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_system|>",
    "<|im_middle|>",
]
# Single tokens of Kimi-K2-Thinking / K2.5 for reasoning and tool calls (the markers llama.cpp's Kimi-K2
# chat parser preserves as whole tokens); appended after the characters so older ids do not move.
KIMI_THINK_TOOL_SPECIALS = [
    "<think>",
    "</think>",
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
]
# ChatML markers (Qwen3-style templates); each a single token as in Qwen3's vocabulary.
CHATML_SPECIALS = ["<|im_start|>"]
WORDS = ["assistant", "system", "user"]  # longest first: greedy matching

# Kimi-K2 style template: every turn is <|im_{role}|>{role}<|im_middle|>{content}<|im_end|> with no
# separator between turns; a default system turn when the conversation has none.
KIMI_CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' -%}"
    "<|im_system|>system<|im_middle|>You are Kimi.<|im_end|>"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}<|im_system|>system<|im_middle|>"
    "{%- elif m['role'] == 'user' -%}<|im_user|>user<|im_middle|>"
    "{%- else -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
    "{{ m['content'] }}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)


class KimiStyleTokenizer(PreTrainedTokenizer):
    """Slow tokenizer: specials, 3 word tokens, printable ASCII + newline characters; ``[UNK]`` otherwise."""

    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, **kwargs):
        chars = ["\n"] + [chr(c) for c in range(32, 127)]
        extra = KIMI_THINK_TOOL_SPECIALS + CHATML_SPECIALS
        tokens = KIMI_SPECIALS + ["[UNK]"] + WORDS + chars + extra
        self._vocab = {t: i for i, t in enumerate(tokens)}
        self._inv = {i: t for t, i in self._vocab.items()}
        kwargs.setdefault("chat_template", KIMI_CHAT_TEMPLATE)
        super().__init__(
            bos_token="[BOS]",
            eos_token="[EOS]",
            unk_token="[UNK]",
            pad_token="[EOS]",
            additional_special_tokens=KIMI_SPECIALS[2:] + extra,
            **kwargs,
        )

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    def get_vocab(self) -> dict:
        return dict(self._vocab)

    def _tokenize(self, text: str, **kwargs) -> list[str]:
        out, i = [], 0
        while i < len(text):
            word = next((w for w in WORDS if text.startswith(w, i)), None)
            if word is not None:
                out.append(word)
                i += len(word)
            else:
                out.append(text[i] if text[i] in self._vocab else "[UNK]")
                i += 1
        return out

    def _convert_token_to_id(self, token: str) -> int:
        return self._vocab.get(token, self._vocab["[UNK]"])

    def _convert_id_to_token(self, index: int) -> str:
        return self._inv.get(index, "[UNK]")

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return "".join(tokens)

    def save_vocabulary(self, save_directory: str, filename_prefix=None):
        return ()
