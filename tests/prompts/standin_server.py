"""A local stand-in for a serving endpoint: SGLang's ``/generate`` and OpenAI's ``/v1/chat/completions``.

Response shapes follow SGLang 0.5.23 (``tokenizer_manager.py``: ``{"text", "output_ids",
"meta_info": {"id", "finish_reason", "prompt_tokens", "completion_tokens", ...}}``, ``output_ids``
ending with the matched stop token) and the OpenAI chat-completions schema (``choices[0].message``
with ``content`` and optional ``reasoning_content``, ``finish_reason``, ``usage``).

Backends: :class:`ModelBackend` runs a real HF model greedily (one request at a time);
:class:`FakeBackend` returns deterministic tokens computed from the prompt ids (fast fault tests).
Faults are injected by ``fault(n, path, body) -> None | "500" | "503" | "400" | "timeout" | "drop" |
"truncate"`` (n = 1-based request number); every request body is recorded in ``requests``.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Optional


class ModelBackend:
    """Greedy decoding with a real HF causal LM, unbatched (the server decodes each request on its own)."""

    def __init__(self, model, tokenizer):
        self.model, self.tok = model, tokenizer
        self.lock = threading.Lock()

    def generate(self, ids: list[int], max_new: int, stop_ids: set[int]) -> tuple[list[int], str]:
        from eagle3.regen.regenerate import generate_greedy

        pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.tok.eos_token_id
        with self.lock:
            ((ans, stopped),) = generate_greedy(self.model, [ids], max_new, stop_ids, pad)
        if stopped is not None:  # SGLang keeps the matched stop token at the end of output_ids
            return ans + [stopped], "stop"
        return ans, "length"

    def reasoning(self, ids: list[int]) -> Optional[str]:
        return None


class FakeBackend:
    """Deterministic answers: 1-4 tokens derived from the prompt ids, then the stop token."""

    def __init__(self, stop_id: int, reasoning: bool = False):
        self.stop_id = stop_id
        self.with_reasoning = reasoning

    def generate(self, ids: list[int], max_new: int, stop_ids: set[int]) -> tuple[list[int], str]:
        s = sum(ids) + len(ids)
        toks = [300 + (s * 7 + 13 * j) % 4000 for j in range(1 + s % 4)]
        if len(toks) > max_new:
            return toks[:max_new], "length"
        return toks + [self.stop_id], "stop"

    def reasoning(self, ids: list[int]) -> Optional[str]:
        return f"thinking about {sum(ids) % 997}" if self.with_reasoning else None


class StandInServer:
    """``ThreadingHTTPServer`` on 127.0.0.1 (a free port) in a daemon thread; use as a context manager."""

    def __init__(
        self,
        backend,
        tokenizer,
        fault: Optional[Callable] = None,
        delay: float = 0.0,
        timeout_sleep: float = 2.0,
    ):
        self.backend, self.tok, self.fault, self.delay = backend, tokenizer, fault, delay
        self.timeout_sleep = timeout_sleep
        self.requests: list[tuple[str, dict]] = []
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):  # quiet
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with outer.lock:
                    outer.requests.append((self.path, body))
                    n = len(outer.requests)
                what = outer.fault(n, self.path, body) if outer.fault else None
                if what == "drop":
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                if what == "timeout":
                    time.sleep(outer.timeout_sleep)
                if what in ("500", "503", "400"):
                    msg = b'{"error": "injected"}'
                    self.send_response(int(what))
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(msg)))
                    self.end_headers()
                    self.wfile.write(msg)
                    return
                if outer.delay:
                    time.sleep(outer.delay)
                if self.path == "/generate":
                    out = outer._generate(body)
                elif self.path == "/v1/chat/completions":
                    out = outer._chat(body)
                else:
                    self.send_error(404)
                    return
                data = json.dumps(out).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if what == "truncate":  # headers promise more bytes than arrive
                    self.wfile.write(data[: len(data) // 2])
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                self.wfile.write(data)

        class Server(ThreadingHTTPServer):
            def handle_error(
                self, request, client_address
            ):  # the client gave up (injected timeout): expected
                import sys

                if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
                    super().handle_error(request, client_address)

        self.httpd = Server(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> "StandInServer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def _generate(self, body: dict) -> dict:
        ids = body["input_ids"]
        sp = body.get("sampling_params") or {}
        stops = set(sp.get("stop_token_ids") or [])
        out, kind = self.backend.generate(ids, sp.get("max_new_tokens", 128), stops)
        fin = (
            {"type": "stop", "matched": out[-1]}
            if kind == "stop"
            else {"type": "length", "length": len(out)}
        )
        return {
            "text": self.tok.decode(out),
            "output_ids": out,
            "meta_info": {
                "id": "x",
                "finish_reason": fin,
                "prompt_tokens": len(ids),
                "completion_tokens": len(out),
                "cached_tokens": 0,
            },
        }

    def _chat(self, body: dict) -> dict:
        kw = body.get("chat_template_kwargs") or {}
        text = self.tok.apply_chat_template(
            body["messages"],
            tokenize=False,
            add_generation_prompt=True,
            tools=body.get("tools"),
            **kw,
        )
        ids = list(self.tok(text, add_special_tokens=False)["input_ids"])
        stops = {self.tok.eos_token_id} | {self.tok.convert_tokens_to_ids("<|im_end|>")}
        out, kind = self.backend.generate(ids, body.get("max_tokens", 128), stops)
        ans = out[:-1] if kind == "stop" else out
        msg = {"role": "assistant", "content": self.tok.decode(ans, skip_special_tokens=True)}
        r = self.backend.reasoning(ids)
        if r is not None:
            msg["reasoning_content"] = r
        if body.get(
            "tools"
        ):  # a model that calls the first declared tool (OpenAI tool_calls shape)
            name = body["tools"][0]["function"]["name"]
            msg.update(
                content="",
                tool_calls=[
                    {
                        "id": f"call_{len(ids)}",
                        "type": "function",
                        "function": {"name": name, "arguments": '{"q": 1}'},
                    }
                ],
            )
            kind = "tool_calls"
        return {
            "id": "chatcmpl-x",
            "object": "chat.completion",
            "model": body.get("model", "standin"),
            # SGLang names the stop id it matched (``matched_stop``), as its OpenAI server does
            "choices": [
                {
                    "index": 0,
                    "message": msg,
                    "finish_reason": kind,
                    **({"matched_stop": out[-1]} if kind == "stop" else {}),
                }
            ],
            "usage": {
                "prompt_tokens": len(ids),
                "completion_tokens": len(out),
                "total_tokens": len(ids) + len(out),
            },
        }
