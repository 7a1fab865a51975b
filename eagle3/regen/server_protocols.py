"""Request protocols of regeneration through endpoints: :class:`SGLangGenerate` (``/generate``,
ids in and out) and :class:`OpenAIChat` (``/v1/chat/completions``, messages in, text out).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable, Optional

from eagle3.chat.template import (
    ChatOptions,
    answer_ending,
    end_of_turn_ids,
    generation_prompt,
    split_reasoning,
)


@dataclass
class Answer:
    """One regenerated assistant turn."""

    content: str
    tokens: Optional[list[int]]  # generated ids (stop token excluded); None for text-only protocols
    reasoning: Optional[str]
    new_tokens: int
    truncated: bool  # hit max_new_tokens
    tool_calls: Optional[list] = None  # OpenAI tool calls the model made (openai protocol)
    # the stop id the answer ended on, when the server says (None: cut or unknown)
    stop_token: Optional[int] = None

    def message(self) -> dict:
        m: dict = {"role": "assistant", "content": self.content}
        if self.reasoning is not None:
            m["reasoning_content"] = self.reasoning
        if self.tool_calls:
            m["tool_calls"] = self.tool_calls
        if self.tokens is not None:
            m["tokens"] = self.tokens
        if self.truncated:  # 02 leaves the template's end-of-turn token out of this answer's loss
            m.update(answer_ending(None))
        elif self.stop_token is not None:
            # as the local engines record it (02: no loss on another end-of-turn)
            m.update(answer_ending(self.stop_token))
        return m


def _token_id(value) -> Optional[int]:
    """``value`` when it is a token id (an ``int`` >= 0, not a bool), else None (a stop string, absent)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


class SGLangGenerate:
    """SGLang native ``/generate``: our token ids in, the server's generated ids out (module docstring)."""

    path = "/generate"

    def __init__(self, tokenizer, pc, opts: ChatOptions):
        self.tok = tokenizer
        self.opts = opts
        self.stop_ids = end_of_turn_ids(tokenizer)
        self.sampling = {
            "max_new_tokens": pc.max_new_tokens,
            "temperature": pc.temperature,
            "top_p": pc.top_p,
            "stop_token_ids": sorted(self.stop_ids),
            **pc.server.extra_body,
        }

    def request(self, messages: list[dict], tools: Optional[list] = None) -> tuple[dict, Callable]:
        head = generation_prompt(self.tok, messages, self.opts, tools)
        ids = list(self.tok(head, add_special_tokens=False)["input_ids"])
        payload = {"input_ids": ids, "sampling_params": self.sampling}
        return payload, lambda resp: self.parse(resp, len(ids), head)

    def parse(self, resp, n_prompt: int, head: str = "") -> Answer:
        """One ``/generate`` response as an :class:`Answer` (``head``: the rendered prompt; ending with
        the open think tag means the answer starts inside the reasoning).

        Raises:
            ValueError: not SGLang's shape, an aborted request, or another prompt length (retryable).
        """
        if isinstance(resp, list) and len(resp) == 1:
            resp = resp[0]
        if (
            not isinstance(resp, dict)
            or not isinstance(resp.get("output_ids"), list)
            or not isinstance(resp.get("meta_info"), dict)
        ):
            raise ValueError(
                f"not an SGLang /generate response (keys: {sorted(resp) if isinstance(resp, dict) else type(resp).__name__})"
            )
        meta = resp["meta_info"]
        fin = meta.get("finish_reason") or {}
        kind = fin.get("type") if isinstance(fin, dict) else str(fin)
        if kind == "abort":
            raise ValueError(f"request aborted by the server: {fin.get('message')}")
        pt = meta.get("prompt_tokens")
        if isinstance(pt, int) and pt != n_prompt:
            raise ValueError(
                f"server prefilled {pt} prompt tokens, {n_prompt} were sent (is --skip-tokenizer-init "
                "or a chat template applied server-side?)"
            )
        ids = [int(t) for t in resp["output_ids"]]
        matched = fin.get("matched") if isinstance(fin, dict) else None
        stop = None
        if kind == "stop" and ids and (ids[-1] == matched or ids[-1] in self.stop_ids):
            # output_ids end with the matched stop token; the template writes it back
            stop, ids = ids[-1], ids[:-1]
        elif kind == "stop" and _token_id(matched) is not None:
            stop = matched  # a server that trims the stop token from output_ids still names it
        # as eagle3.regen.regenerate does: think tags may be special tokens, so split the text with specials kept
        text = self.tok.decode(ids, skip_special_tokens=True)
        tags = tuple(self.opts.think_tags)
        reasoning, answer = split_reasoning(
            self.tok.decode(ids, skip_special_tokens=False), tags, head.rstrip().endswith(tags[0])
        )
        if reasoning is not None:
            text = answer
        return Answer(text, ids, reasoning, len(ids), truncated=kind == "length", stop_token=stop)


class OpenAIChat:
    """OpenAI-compatible ``/v1/chat/completions``: messages in, text (+ reasoning) out (module docstring)."""

    path = "/v1/chat/completions"

    def __init__(self, tokenizer, pc, opts: ChatOptions):
        self.tok = tokenizer
        self.base = {
            "max_tokens": pc.max_new_tokens,
            "temperature": pc.temperature,
            "top_p": pc.top_p,
            "stream": False,
        }
        if pc.server.model:
            self.base["model"] = pc.server.model
        if opts.template_kwargs:
            self.base["chat_template_kwargs"] = dict(opts.template_kwargs)
        self.base.update(pc.server.extra_body)

    def request(self, messages: list[dict], tools: Optional[list] = None) -> tuple[dict, Callable]:
        # history with the earlier answers' reasoning (SGLang and vLLM take ``reasoning_content`` in
        # assistant messages): the server's template then sees the messages stage 02 renders and
        # decides itself whether earlier reasoning stays (Kimi and Qwen3 drop it)
        keep = ("role", "content", "tool_calls", "reasoning_content")
        msgs = [{k: v for k, v in m.items() if k in keep} for m in messages]
        body = {**self.base, "messages": msgs}
        if tools:
            body["tools"] = tools
        return body, self.parse

    def parse(self, resp) -> Answer:
        """Check one chat-completions response and turn it into an :class:`Answer`.

        Raises:
            ValueError: not the OpenAI shape, or no text at all (retryable).
        """
        try:
            choice = resp["choices"][0]
            msg = choice["message"]
        except (KeyError, IndexError, TypeError) as e:
            raise ValueError(
                f"not an OpenAI chat completion (body starts {json.dumps(resp)[:160]})"
            ) from e
        if choice.get("finish_reason") == "abort":
            raise ValueError("request aborted by the server")
        content = msg.get("content") or ""
        reasoning = msg.get("reasoning_content")
        if reasoning is None:
            reasoning = msg.get("reasoning")  # vLLM >= 0.10 name
        if not content and not reasoning and not msg.get("tool_calls"):
            if choice.get("finish_reason") != "length":
                raise ValueError("empty answer (no content, no reasoning)")
        usage = resp.get("usage") or {}
        n = usage.get("completion_tokens")
        if not isinstance(n, int):
            n = len(self.tok((reasoning or "") + content, add_special_tokens=False)["input_ids"])
        ans = Answer(content, None, reasoning, n, truncated=choice.get("finish_reason") == "length")
        # the stop id, where the server names it (SGLang ``matched_stop``, vLLM ``stop_reason``; a stop string or
        # vLLM's None for the tokenizer's EOS: not recorded)
        if choice.get("finish_reason") == "stop":
            named = (_token_id(choice.get(k)) for k in ("matched_stop", "stop_reason"))
            ans.stop_token = next((t for t in named if t is not None), None)
        if msg.get("tool_calls"):
            ans.tool_calls = msg["tool_calls"]
        return ans
