"""Stage 01 regeneration through serving endpoints: SGLang native ``/generate`` or OpenAI chat.

For a verifier too large to run in-process (Kimi-K2.5: 1T parameters), the answers the drafter
trains on are produced by the serving stack itself (``prompts.regenerate_via``):

* ``sglang``: SGLang's native ``POST /generate`` (``GenerateReqInput``, SGLang 0.5.23
  ``srt/managers/io_struct.py``). The prompt is rendered HERE, exactly as the local path and stage 02
  render a context (:func:`eagle3.prompts.chat.generation_prompt`: the verifier's chat template,
  ``verifier.chat_template_kwargs``, the record's ``tools``, the generation prompt) and sent as
  ``input_ids``; the body is ``{"input_ids": [...], "sampling_params": {"max_new_tokens",
  "temperature", "top_p", "stop_token_ids", ...}}``. The response is ``{"text", "output_ids",
  "meta_info": {"finish_reason": {"type": "stop", "matched": id} | {"type": "length", ...} |
  {"type": "abort", ...}, "prompt_tokens", "completion_tokens", ...}}``; ``output_ids`` include
  the matched stop token (``Req.output_ids_through_stop``), which is cut off here and recorded as the message's
  ``stop_token`` (as the local engines record it: 02 leaves the template's end-of-turn token out of the loss when
  the answer stopped on another id); ``finish_reason`` ``length`` is recorded as ``truncated: true``. The remaining ids
  are stored as the assistant message's ``tokens`` (stage 02 uses them verbatim) and decoded for
  ``content``, split at ``verifier.think_tags`` into ``reasoning_content`` + ``content`` exactly like
  the local path (:mod:`eagle3.prompts.regenerate`). ``meta_info.prompt_tokens`` must equal the number of
  ids sent (the server took our tokenisation as is).
* ``openai``: ``POST /v1/chat/completions`` (vLLM, SGLang, hosted APIs) with ``messages`` (earlier
  answers with their ``reasoning_content``, as stage 02 renders them),
  ``max_tokens``, ``temperature``, ``top_p``, ``chat_template_kwargs`` (``verifier.chat_template_kwargs``,
  as SGLang and vLLM take them) and the record's ``tools``. Text comes back:
  ``choices[0].message.content``, ``tool_calls`` when the model called a tool, and, where the server
  splits reasoning, ``reasoning_content`` (SGLang, vLLM < 0.10) or ``reasoning`` (newer vLLM),
  stored as the message's ``reasoning_content``. No ``tokens``: stage 02 tokenizes the text. ``stop_token`` is
  recorded when the choice names the stop id (SGLang ``matched_stop``, vLLM ``stop_reason``), else not (02 then
  counts the answer as stopped on the template's end-of-turn token); ``length`` is recorded as ``truncated: true``.

Multi-turn conversations are answered turn by turn like the local path: turn k's prompt holds the
user turns 0..k and the regenerated answers 0..k-1. Conversations holding tool results are kept as
they are (the results answer the original calls; no tools run here), as the local path does.

Load, faults and resume: requests go through :class:`eagle3.prompts.endpoints.EndpointPool` (several
endpoints, ``requests_per_endpoint`` in flight each, timeouts, retries with exponential backoff,
dead endpoints out of rotation). A conversation whose request fails for good is reported on one
``error:`` line, counted (``failed``, ``failed_ids``) and left out; the run goes on. Each finished
conversation is appended to a resume log (``prompts.regen-partial.jsonl``, one JSON line, flushed
and fsynced) before it counts as done; a killed run rerun with the same settings skips what the log
holds and redoes only the rest, so no answer is lost or duplicated (:class:`ResumeLog`).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

from tqdm import tqdm

from eagle3.config.prompts import PromptsConfig
from eagle3.errors import UserError
from eagle3.prompts.chat import (
    ChatOptions,
    answer_ending,
    end_of_turn_ids,
    generation_prompt,
    split_reasoning,
)
from eagle3.prompts.endpoints import EndpointPool, RequestFailed, RetryPolicy
from eagle3.prompts.resume_log import PARTIAL_NAME, ResumeLog, log_resuming  # noqa: F401 - PARTIAL_NAME: part of this module's API

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# protocols
# ---------------------------------------------------------------------------------------------
@dataclass
class Answer:
    """One regenerated assistant turn."""

    content: str
    tokens: Optional[list[int]]  # generated ids (stop token excluded); None for text-only protocols
    reasoning: Optional[str]
    new_tokens: int
    truncated: bool  # hit max_new_tokens
    tool_calls: Optional[list] = None  # OpenAI tool calls the model made (openai protocol)
    stop_token: Optional[int] = (
        None  # the stop id the answer ended on, when the server says (None: cut or unknown)
    )

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
        elif (
            self.stop_token is not None
        ):  # as the local engines record it (02: no loss on another end-of-turn)
            m.update(answer_ending(self.stop_token))
        return m


def _token_id(value) -> Optional[int]:
    """``value`` when it is a token id (an ``int`` >= 0, not a bool), else None (a stop string, absent)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


class SGLangGenerate:
    """SGLang native ``/generate``: our token ids in, the server's generated ids out (module docstring)."""

    path = "/generate"

    def __init__(self, tokenizer, pc: PromptsConfig, opts: ChatOptions):
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
        """Check one ``/generate`` response and turn it into an :class:`Answer`.

        ``head``: the rendered prompt text (a prompt ending with the open think tag means the answer
        starts inside the reasoning, Kimi thinking mode).

        Raises:
            ValueError: not SGLang's shape, an aborted request, or a prompt length other than sent
                (a retryable failure for :meth:`eagle3.prompts.endpoints.EndpointPool.post`).
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
            stop, ids = (
                ids[-1],
                ids[:-1],
            )  # output_ids end with the matched stop token; the template writes it back
        elif kind == "stop" and _token_id(matched) is not None:
            stop = matched  # a server that trims the stop token from output_ids still names it
        # as eagle3.prompts.regenerate does: think tags may be special tokens, so split the text with specials kept
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

    def __init__(self, tokenizer, pc: PromptsConfig, opts: ChatOptions):
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
        msgs = [
            {
                k: v
                for k, v in m.items()
                if k in ("role", "content", "tool_calls", "reasoning_content")
            }
            for m in messages
        ]
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
        if (
            choice.get("finish_reason") == "stop"
        ):  # the stop id, where the server names it (SGLang ``matched_stop``,
            # vLLM ``stop_reason``; a stop string or vLLM's None for the tokenizer's EOS: not recorded)
            ans.stop_token = next(
                (
                    _token_id(choice.get(k))
                    for k in ("matched_stop", "stop_reason")
                    if _token_id(choice.get(k)) is not None
                ),
                None,
            )
        if msg.get("tool_calls"):
            ans.tool_calls = msg["tool_calls"]
        return ans


# ---------------------------------------------------------------------------------------------
# orchestration
# ---------------------------------------------------------------------------------------------
class _ConversationFailed(Exception):
    def __init__(self, idx: int, turn: int, turns: int, attempts: int, message: str):
        super().__init__(message)
        self.idx, self.turn, self.turns, self.attempts = idx, turn, turns, attempts


class _Progress:
    """tqdm bar over answers with answers/s (tqdm's rate) and generated tokens/s in the postfix."""

    def __init__(self, total: int):
        self.bar = tqdm(total=total, desc="regenerate", unit="answer", dynamic_ncols=True)
        self.t0 = time.perf_counter()
        self.tokens = 0
        self._lock = threading.Lock()
        self._last = 0.0

    def update(self, answers: int, tokens: int = 0) -> None:
        with self._lock:
            self.tokens += tokens
            self.bar.update(answers)
            now = time.perf_counter()
            if now - self._last > 0.5:
                self._last = now
                self.bar.set_postfix_str(
                    f"{self.tokens / max(now - self.t0, 1e-9):.1f} tok/s", refresh=False
                )

    def close(self) -> None:
        self.bar.close()


class _OverContext(Exception):
    """A conversation whose first prompt already reaches the context cap (left out, not failed)."""

    def __init__(self, idx: int):
        super().__init__(idx)
        self.idx = idx


def _user_turns(conv: dict) -> tuple[list[dict], list[str]]:
    msgs = conv["messages"]
    system = [dict(msgs[0])] if msgs and msgs[0]["role"] == "system" else []
    return system, [m["content"] for m in msgs if m["role"] == "user"]


def regenerate_via_server(
    conversations: list[dict],
    tokenizer,
    pc: PromptsConfig,
    opts: Optional[ChatOptions] = None,
    *,
    partial_path: str | os.PathLike,
    settings: dict,
    stats: Optional[dict] = None,
    pool: Optional[EndpointPool] = None,
    max_context: Optional[int] = None,
) -> list[dict]:
    """Replace every assistant turn with the serving endpoint's answer, turn by turn, resumably.

    Args:
        conversations: normalised ``{id, messages}`` (prompt-only ones included).
        tokenizer: the verifier's tokenizer (renders prompts for ``sglang``; decodes answers).
        pc: ``prompts`` config: ``regenerate_via`` (``sglang``|``openai``), sampling
            (``max_new_tokens``, ``temperature``, ``top_p``) and ``server`` (endpoints and policy).
        partial_path: the resume log (:class:`ResumeLog`); kept while any conversation is missing,
            deleted by the caller after the final file is written.
        settings: fingerprint stored in the log; a log with other settings is refused.
        opts: rendering options (:meth:`eagle3.prompts.chat.ChatOptions.from_config`): template,
            ``chat_template_kwargs`` (rendered with for ``sglang``, sent for ``openai``), ``reply_start``,
            think tags.
        stats: filled with ``answers``, ``new_tokens``, ``truncated``, ``failed``, ``failed_ids``,
            ``retries``, ``resumed`` (conversations taken from the log), ``kept_with_tools``,
            ``seconds``, ``endpoints``, ``turns_over_context``, ``dropped_over_context``.
        pool: endpoint pool to use (default: built from ``pc.server``).
        max_context: context cap in tokens, as in :func:`eagle3.prompts.regenerate.regenerate`: a turn whose
            rendered prompt has at least this many tokens is not sent (nor are the later ones); a
            conversation whose first prompt reaches it is left out. None = no cap.

    Returns:
        Finished conversations ``{id, messages, tools?}`` in input order (failed ones left out):
        optional system message, then alternating user / regenerated assistant turns (see
        :class:`Answer` for the fields); conversations with tool results unchanged.

    Raises:
        UserError: bad endpoint settings, a resume log from other settings, or every endpoint down
            for ``give_up_after_s`` (finished conversations stay in the log).
    """
    sc = pc.server
    opts = opts if opts is not None else ChatOptions()
    proto = _protocol(tokenizer, pc, opts)
    check_reachable = pool is None
    if pool is None:
        pool = _endpoint_pool(sc)
    policy = RetryPolicy(sc.max_attempts, sc.backoff_s, sc.backoff_max_s)
    journal = ResumeLog(partial_path, settings)
    done, passthrough, todo, resumed = _plan(conversations, journal)
    st = {
        "answers": 0,
        "new_tokens": 0,
        "truncated": 0,
        "failed": 0,
        "failed_ids": [],
        "retries": 0,
        "resumed": resumed,
        "kept_with_tools": len(passthrough),
        "seconds": 0.0,
        "turns_over_context": 0,
        "dropped_over_context": 0,
    }
    if passthrough:
        log.warning(
            "%d conversations with tool results kept as they are (not regenerated)",
            len(passthrough),
        )
    if resumed:
        print(
            f"resuming: {resumed} of {len(conversations)} conversations already regenerated ({journal.path})"
        )
    if todo and check_reachable:
        pool.preflight(timeout=min(sc.timeout_s, 30.0))
    job = _ServerJob(
        conversations,
        tokenizer,
        opts,
        proto,
        pool,
        policy,
        sc.timeout_s,
        journal,
        max_context,
        st,
        total_turns=sum(len(_user_turns(conversations[i])[1]) for i in todo),
    )
    t0 = time.perf_counter()
    job.run(todo, done)
    st["seconds"] = time.perf_counter() - t0
    st["endpoints"] = pool.summary()
    if stats is not None:
        stats.update(st)
    return [done[i] for i in range(len(conversations)) if i in done]


def _protocol(tokenizer, pc: PromptsConfig, opts: ChatOptions):
    """The request builder / response checker of ``prompts.regenerate_via``."""
    if pc.regenerate_via == "sglang":
        return SGLangGenerate(tokenizer, pc, opts)
    if pc.regenerate_via == "openai":
        return OpenAIChat(tokenizer, pc, opts)
    raise ValueError(f"regenerate_via_server: unsupported regenerate_via {pc.regenerate_via!r}")


def _endpoint_pool(sc) -> EndpointPool:
    """The :class:`EndpointPool` of ``prompts.server`` (bearer key from ``api_key_env`` when set).

    Raises:
        UserError: ``api_key_env`` names an unset environment variable.
    """
    headers = {}
    if sc.api_key_env:
        key = os.environ.get(sc.api_key_env)
        if not key:
            raise UserError(
                f"prompts.server.api_key_env: environment variable {sc.api_key_env} is not set"
            )
        headers["Authorization"] = f"Bearer {key}"
    return EndpointPool(
        sc.urls,
        sc.requests_per_endpoint,
        sc.dead_after,
        sc.revive_after_s,
        sc.give_up_after_s,
        headers=headers,
    )


def _plan(
    conversations: list[dict], journal: ResumeLog
) -> tuple[dict[int, dict], list[int], list[int], int]:
    """``(done, passthrough, todo, resumed)``: conversations finished in the resume log (``resumed`` of them) or
    kept as they are (tool results answer the ORIGINAL calls, as :mod:`eagle3.prompts.regenerate` does), and the
    indices still to do.

    Raises:
        UserError: a resume log written with other settings or input (:meth:`ResumeLog.load`).
    """
    done = journal.load(conversations)
    resumed = len(done)
    log_resuming(resumed, len(conversations))
    passthrough = [
        i
        for i, c in enumerate(conversations)
        if any(m["role"] == "tool" or m.get("tool_calls") for m in c["messages"])
    ]
    for i in passthrough:
        done[i] = conversations[i]
    todo = [i for i in range(len(conversations)) if i not in done]
    return done, passthrough, todo, resumed


class _ServerJob:
    """The concurrent part of :func:`regenerate_via_server`: one daemon thread per request slot of the pool,
    each answering whole conversations turn by turn (:meth:`answer`), results collected on the calling thread
    (:meth:`run`); ``stats`` is updated under a lock."""

    def __init__(
        self,
        conversations,
        tokenizer,
        opts,
        proto,
        pool,
        policy,
        timeout_s,
        journal,
        max_context,
        stats,
        total_turns: int,
    ):
        self.convs, self.tok, self.opts, self.proto, self.pool = (
            conversations,
            tokenizer,
            opts,
            proto,
            pool,
        )
        self.policy, self.timeout_s, self.journal, self.max_context, self.st = (
            policy,
            timeout_s,
            journal,
            max_context,
            stats,
        )
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.prog = _Progress(total_turns)

    def answer(self, i: int) -> dict:
        """Regenerate conversation ``i`` (appended to the resume log when finished).

        Raises:
            _OverContext: its first prompt reaches ``max_context``.
            _ConversationFailed: a request failed for good.
            InterruptedError: the run is stopping.
        """
        conv_in, st = self.convs[i], self.st
        msgs, users = _user_turns(conv_in)
        for k, u in enumerate(users):
            if self.stop.is_set():
                raise InterruptedError
            msgs.append({"role": "user", "content": u})
            if (
                self.max_context is not None
                and len(
                    self.tok(
                        generation_prompt(self.tok, msgs, self.opts, conv_in.get("tools")),
                        add_special_tokens=False,
                    )["input_ids"]
                )
                >= self.max_context
            ):
                msgs.pop()
                self.prog.update(len(users) - k)
                with self.lock:
                    st["turns_over_context"] += len(users) - k
                if k == 0:
                    raise _OverContext(i)
                break
            payload, check = self.proto.request(msgs, conv_in.get("tools"))
            try:
                ans, attempts = self.pool.post(
                    self.proto.path, payload, self.timeout_s, self.policy, check=check
                )
            except RequestFailed as e:
                self.prog.update(len(users) - k)
                raise _ConversationFailed(i, k, len(users), e.attempts, str(e)) from e
            msgs.append(ans.message())
            with self.lock:
                st["answers"] += 1
                st["new_tokens"] += ans.new_tokens
                st["truncated"] += int(ans.truncated)
                st["retries"] += attempts - 1
            self.prog.update(1, ans.new_tokens)
        conv = {"id": conv_in["id"], "messages": msgs}
        if conv_in.get("tools"):
            conv["tools"] = conv_in["tools"]
        self.journal.append(i, conv)
        return conv

    def run(self, todo: list[int], done: dict[int, dict]) -> None:
        """Answer every conversation of ``todo`` into ``done``; failures are counted and reported on one
        ``error:`` line each, anything else (``UserError`` of a dead pool, Ctrl-C) ends the run."""
        self.journal.open()
        # Daemon worker threads (not a ThreadPoolExecutor, whose threads the interpreter joins at exit): on
        # Ctrl-C or an error the run ends at once instead of waiting up to timeout_s for requests in flight;
        # what finished is in the fsynced log, what did not is redone by the next run.
        tasks: queue.Queue = queue.Queue()
        results: queue.Queue = queue.Queue()
        for i in todo:
            tasks.put(i)

        def worker() -> None:
            while not self.stop.is_set():
                try:
                    i = tasks.get_nowait()
                except queue.Empty:
                    return
                try:
                    results.put((i, self.answer(i), None))
                except BaseException as e:  # noqa: BLE001 - handed to the main thread
                    results.put((i, None, e))

        threads = [
            threading.Thread(target=worker, name=f"regen-{k}", daemon=True)
            for k in range(min(self.pool.capacity, len(todo)))
        ]
        for t in threads:
            t.start()
        try:
            for _ in range(len(todo)):
                while True:
                    try:  # a timeout keeps the main thread responsive to Ctrl-C
                        i, conv, err = results.get(timeout=0.5)
                        break
                    except queue.Empty:
                        continue
                if err is None:
                    done[i] = conv
                else:
                    self._failed(i, err)
        finally:
            self.stop.set()
            self.prog.close()
            self.journal.close()

    def _failed(self, i: int, err: BaseException) -> None:
        """Count a conversation left out (over the context cap, or failed for good); re-raise anything else."""
        if isinstance(err, _OverContext):
            self.st["dropped_over_context"] += 1
        elif isinstance(err, _ConversationFailed):
            cid = self.convs[i]["id"]
            self.st["failed"] += 1
            self.st["failed_ids"].append(cid)
            tqdm.write(
                f"error: regenerate: conversation {cid!r} turn {err.turn + 1}/{err.turns} failed after "
                f"{err.attempts} attempt(s): {err}; counted as failed, the run goes on",
                file=sys.stderr,
            )
        else:
            raise err
