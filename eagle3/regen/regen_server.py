"""Stage 01 regeneration through serving endpoints (``prompts.regenerate_via``).

* ``sglang``: ``POST /generate`` with ``input_ids`` rendered here
  (:func:`eagle3.chat.template.generation_prompt`); the matched stop id is cut off and recorded as
  ``stop_token`` (``length``: ``truncated: true``); the remaining ids are the message's ``tokens``,
  decoded and split at ``verifier.think_tags``. ``meta_info.prompt_tokens`` must equal the ids sent.
* ``openai``: ``POST /v1/chat/completions`` with ``messages``, sampling, ``chat_template_kwargs``
  and ``tools``; text comes back (no ``tokens``), ``stop_token`` when the choice names it.

Requests go through :class:`eagle3.regen.endpoints.EndpointPool`; a conversation whose request
fails for good is reported and left out. Finished conversations are appended to the resume log.
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from tqdm import tqdm

from eagle3.chat.template import ChatOptions, generation_prompt, has_tool_calls, user_turns
from eagle3.errors import UserError
from eagle3.regen.endpoints import EndpointPool, RequestFailed, RetryPolicy
from eagle3.regen.resume_log import ResumeLog, log_resuming
from eagle3.regen.server_protocols import OpenAIChat, SGLangGenerate

log = logging.getLogger(__name__)


class _ConversationFailed(Exception):
    """A request failed for good; the message names the conversation, its turn and the attempts made."""


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


class _OverContext(Exception):
    """A conversation whose first prompt already reaches the context cap (left out, not failed)."""


def regenerate_via_server(
    conversations: list[dict],
    tokenizer,
    pc,
    opts: Optional[ChatOptions] = None,
    *,
    partial_path: str | os.PathLike,
    settings: dict,
    stats: Optional[dict] = None,
    pool: Optional[EndpointPool] = None,
    max_context: Optional[int] = None,
) -> list[dict]:
    """Replace every assistant turn with the endpoint's answer, turn by turn, resumably.

    Args:
        conversations: normalised ``{id, messages}``.
        tokenizer: the verifier's tokenizer (renders ``sglang`` prompts, decodes answers).
        pc: ``prompts`` config (``regenerate_via``, sampling, ``server``).
        partial_path: the resume log; settings: its fingerprint (other settings: refused).
        opts: :class:`eagle3.chat.template.ChatOptions`.
        stats: filled with ``answers``, ``new_tokens``, ``truncated``, ``failed``, ``failed_ids``,
            ``retries``, ``resumed``, ``kept_with_tools``, ``seconds``, ``endpoints``,
            ``turns_over_context``, ``dropped_over_context``.
        pool: endpoint pool (default: from ``pc.server``).
        max_context: token cap as in :func:`eagle3.regen.regenerate.regenerate`.

    Returns:
        finished conversations ``{id, messages, tools?}`` in input order (failed ones left out).

    Raises:
        UserError: bad endpoint settings, a resume log of other settings, every endpoint down.
    """
    sc = pc.server
    opts = opts if opts is not None else ChatOptions()
    pool, check_reachable = (pool, False) if pool is not None else (_endpoint_pool(sc), True)
    journal = ResumeLog(partial_path, settings)
    done, todo, st = _plan(conversations, journal)
    if todo and check_reachable:
        pool.preflight(timeout=min(sc.timeout_s, 30.0))
    job = _ServerJob(
        conversations,
        tokenizer,
        opts,
        # the request builder / response checker of ``prompts.regenerate_via``
        {"sglang": SGLangGenerate, "openai": OpenAIChat}[pc.regenerate_via](tokenizer, pc, opts),
        pool,
        RetryPolicy(sc.max_attempts, sc.backoff_s, sc.backoff_max_s),
        sc.timeout_s,
        journal,
        max_context,
        st,
        _Progress(sum(len(user_turns(conversations[i])[1]) for i in todo)),
    )
    t0 = time.perf_counter()
    job.run(todo, done)
    st.update(seconds=time.perf_counter() - t0, endpoints=pool.summary())
    if stats is not None:
        stats.update(st)
    return [done[i] for i in range(len(conversations)) if i in done]


def _plan(conversations: list[dict], journal: ResumeLog) -> tuple[dict[int, dict], list[int], dict]:
    """``(done, todo, stats)``: the conversations finished in the resume log or kept as they are (tool results), the
    indices still to do, and the run's zeroed figures (:func:`regenerate_via_server`'s ``stats``); warns about the
    kept ones and prints the resumed count.

    Raises:
        UserError: a resume log of other settings or input.
    """
    done = journal.load(conversations)
    resumed = len(done)
    log_resuming(resumed, len(conversations))
    # tool results answer the original calls: such a conversation is kept as it is
    passthrough = [i for i, c in enumerate(conversations) if has_tool_calls(c)]
    done.update((i, conversations[i]) for i in passthrough)
    todo = [i for i in range(len(conversations)) if i not in done]
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
    return done, todo, st


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


@dataclass
class _ServerJob:
    """The concurrent part of :func:`regenerate_via_server`: one daemon thread per request slot of the pool,
    each answering whole conversations turn by turn (:meth:`answer`), results collected on the calling thread
    (:meth:`run`); ``st`` (the run's figures) is updated under ``lock``; ``proto``: :mod:`server_protocols`."""

    convs: list[dict]
    tok: Any
    opts: ChatOptions
    proto: Any
    pool: EndpointPool
    policy: RetryPolicy
    timeout_s: float
    journal: ResumeLog
    max_context: Optional[int]
    st: dict
    prog: _Progress
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def answer(self, i: int) -> dict:
        """Regenerate conversation ``i`` (appended to the resume log when finished).

        Raises:
            _OverContext: its first prompt reaches ``max_context``.
            _ConversationFailed: a request failed for good.
            InterruptedError: the run is stopping.
        """
        conv_in, st = self.convs[i], self.st
        tools = conv_in.get("tools")
        system, users = user_turns(conv_in)
        msgs = [dict(system)] if system else []
        for k, u in enumerate(users):
            if self.stop.is_set():
                raise InterruptedError
            msgs.append({"role": "user", "content": u})
            head = self.max_context is not None and generation_prompt(
                self.tok, msgs, self.opts, tools
            )
            if (
                head
                and len(self.tok(head, add_special_tokens=False)["input_ids"]) >= self.max_context
            ):
                msgs.pop()
                self.prog.update(len(users) - k)
                with self.lock:
                    st["turns_over_context"] += len(users) - k
                if k == 0:
                    raise _OverContext
                break
            payload, check = self.proto.request(msgs, tools)
            try:
                ans, attempts = self.pool.post(
                    self.proto.path, payload, self.timeout_s, self.policy, check=check
                )
            except RequestFailed as e:
                self.prog.update(len(users) - k)
                raise _ConversationFailed(
                    f"conversation {conv_in['id']!r} turn {k + 1}/{len(users)} failed after {e.attempts} "
                    f"attempt(s): {e}"
                ) from e
            msgs.append(ans.message())
            with self.lock:
                st["answers"] += 1
                st["new_tokens"] += ans.new_tokens
                st["truncated"] += int(ans.truncated)
                st["retries"] += attempts - 1
            self.prog.update(1, ans.new_tokens)
        conv = {"id": conv_in["id"], "messages": msgs, **({"tools": tools} if tools else {})}
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

        for k in range(min(self.pool.capacity, len(todo))):
            threading.Thread(target=worker, name=f"regen-{k}", daemon=True).start()
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
            self.prog.bar.close()
            self.journal.close()

    def _failed(self, i: int, err: BaseException) -> None:
        """Count a conversation left out (over the context cap, or failed for good); re-raise anything else."""
        if isinstance(err, _OverContext):
            self.st["dropped_over_context"] += 1
        elif isinstance(err, _ConversationFailed):
            self.st["failed"] += 1
            self.st["failed_ids"].append(self.convs[i]["id"])
            tqdm.write(
                f"error: regenerate: {err}; counted as failed, the run goes on", file=sys.stderr
            )
        else:
            raise err
