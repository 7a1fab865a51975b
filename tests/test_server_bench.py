"""SGLang server benchmark against a local stand-in HTTP server answering like SGLang 0.5.23.

The stand-in's ``/generate`` response copies the shape of SGLang 0.5.23
``tokenizer_manager._handle_batch_output`` + ``_calculate_spec_decoding_metrics`` (non-streaming):
``{"text", "output_ids", "meta_info": {id, finish_reason, prompt_tokens, completion_tokens,
cached_tokens, e2e_latency, [spec_accept_rate, spec_accept_length, spec_num_correct_drafts,
spec_num_proposed_drafts, spec_verify_ct, spec_correct_drafts_histogram]}}``.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from eagle3.errors import UserError
from eagle3.server_bench import bench_server, generate, run_server_bench

STEPS = 3


def _answer(input_ids: list[int], max_new: int, speculative: bool) -> dict:
    """Deterministic fake decode: output = (sum(prompt) + i) % 1000; histogram depends on the prompt."""
    out = [(sum(input_ids) + i) % 1000 for i in range(max_new)]
    meta = {"id": "r", "finish_reason": {"type": "length", "length": max_new}, "prompt_tokens": len(input_ids),
            "weight_version": "default", "num_retractions": 0, "reasoning_tokens": 0,
            "completion_tokens": max_new, "cached_tokens": 0, "e2e_latency": 0.01}
    if speculative:
        # prompt of length L: hist[a] = steps that accepted a drafts (sum of (a+1)*hist = completion tokens)
        hist = [0, 0, 0, 0]
        hist[len(input_ids) % 4] = 1
        rest = max_new - (len(input_ids) % 4 + 1)
        hist[1] += rest // 2  # each adds 2 tokens
        hist[0] += rest % 2
        verify = sum(hist)
        correct = sum(a * c for a, c in enumerate(hist))
        meta.update({"spec_accept_rate": correct / (verify * STEPS), "spec_accept_length": max_new / verify,
                     "spec_num_correct_drafts": correct, "spec_num_proposed_drafts": verify * STEPS,
                     "spec_verify_ct": verify, "spec_correct_drafts_histogram": hist})
    return {"text": " ".join(map(str, out)), "output_ids": out, "meta_info": meta}


class _StandIn:
    def __init__(self, speculative: bool, fail: bool = False):
        self.requests: list[dict] = []
        outer = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, code: int, obj):
                body = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if self.path == "/server_info":
                    info = {"model_path": "tiny", "speculative_algorithm": "EAGLE3" if speculative else None,
                            "speculative_num_steps": STEPS if speculative else None, "speculative_eagle_topk": 1,
                            "speculative_num_draft_tokens": STEPS + 1, "unrelated": 1}
                    self._send(200, info)
                else:
                    self._send(404, {"detail": "Not Found"})

            def do_POST(self):
                req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append(req)
                if fail or self.path != "/generate":
                    self._send(400, {"error": {"message": "bad request body", "type": "invalid_request_error"}})
                    return
                sp = req["sampling_params"]
                self._send(200, _answer(req["input_ids"], sp["max_new_tokens"], speculative))

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


PROMPTS = [("a", [1, 2, 3]), ("b", [4, 5, 6, 7, 8]), ("c", [9] * 6)]


def test_generate_sends_greedy_request_and_reads_meta_info():
    with _StandIn(speculative=True) as s:
        r = generate(s.url, [1, 2, 3], 9)
        assert s.requests[-1] == {"input_ids": [1, 2, 3], "sampling_params": {"temperature": 0, "max_new_tokens": 9}}
    assert r["output_ids"] == [(6 + i) % 1000 for i in range(9)]
    assert r["meta_info"]["completion_tokens"] == 9 and r["seconds"] > 0


@pytest.mark.parametrize("concurrency", [1, 3])
def test_bench_server_pools_tau_and_histogram(concurrency):
    with _StandIn(speculative=True) as s:
        res = bench_server(s.url, PROMPTS, 10, concurrency=concurrency, progress=False)
        assert len(s.requests) == 1 + len(PROMPTS)  # warm-up + one per prompt
    # hand-computed from the stand-in's rule (max_new 10): prompt lengths 3, 5, 6 give
    # L=3: [0,3,0,1], L=5: [0,5,0,0], L=6: [1,3,1,0]  (sum of (a+1)*hist[a] = 10 each)
    hists = [_answer(ids, 10, True)["meta_info"]["spec_correct_drafts_histogram"] for _, ids in PROMPTS]
    assert hists == [[0, 3, 0, 1], [0, 5, 0, 0], [1, 3, 1, 0]]
    pooled = [1, 11, 1, 1]
    assert res["speculative"] and res["steps"] == STEPS
    assert res["completion_tokens"] == 30 and res["verify_steps"] == 14
    assert res["tau"] == pytest.approx(30 / 14)
    assert res["accepted_hist"] == pooled
    # reach >=0: 14, >=1: 13, >=2: 2, >=3: 1
    assert res["conditional"] == pytest.approx([13 / 14, 2 / 13, 1 / 2])
    assert res["unconditional"] == pytest.approx([13 / 14, 2 / 14, 1 / 14])
    assert res["tau"] == pytest.approx(1 + sum(res["unconditional"]))
    assert res["mean_spec_accept_length"] == pytest.approx((10 / 4 + 10 / 5 + 10 / 5) / 3)
    assert res["server_info"] == {"model_path": "tiny", "speculative_algorithm": "EAGLE3", "speculative_num_steps": 3,
                                  "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 4}
    assert [r["id"] for r in res["per_request"]] == ["a", "b", "c"]  # request order kept under concurrency
    assert res["output_tokens_per_s"] == pytest.approx(30 / res["wall_seconds"])


def test_two_servers_speedup_and_reports(tmp_path):
    with _StandIn(speculative=True) as spec, _StandIn(speculative=False) as base:
        rep = run_server_bench([spec.url, base.url], PROMPTS, 8, concurrency=2, dataset="mtbench",
                               out_dir=tmp_path, progress=False)
    a, b = rep["servers"]
    assert a["speculative"] and not b["speculative"] and "tau" not in b
    assert rep["speedup"] == pytest.approx(a["output_tokens_per_s"] / b["output_tokens_per_s"])
    assert rep["identical_outputs"] == 3
    saved = json.loads((tmp_path / "server_bench.json").read_text())
    assert saved["servers"][0]["tau"] == pytest.approx(a["tau"])
    md = (tmp_path / "server_bench.md").read_text()
    assert f"| {spec.url} | yes | {a['tau']:.2f} |" in md and f"| {base.url} | no | n/a |" in md
    assert "identical outputs: 3/3" in md
    assert (tmp_path / "server_acceptance.png").read_bytes()[:4] == b"\x89PNG"


def test_server_errors_are_user_errors(tmp_path):
    with _StandIn(speculative=True, fail=True) as s:
        with pytest.raises(UserError, match=r"HTTP 400: .*bad request body"):
            generate(s.url, [1], 4)
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    with pytest.raises(UserError, match="cannot connect"):
        generate(f"http://127.0.0.1:{port}", [1], 4, timeout=5)
    with pytest.raises(UserError, match="1 or 2 URLs"):
        run_server_bench([], PROMPTS, 4)


def test_cli_server_mode_sends_chat_rendered_prompts(tmp_path, tiny_llama_dir, smollm_tokenizer):
    import importlib.util

    from conftest import ROOT
    from eagle3.chat import render

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "x", "prompt": "Hello there"}) + "\n" + json.dumps({"id": "y", "prompt": "Bye"}) + "\n")
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"run_name: t\noutput_root: {tmp_path / 'out'}\nverifier: {{path: {tiny_llama_dir}}}\n"
                   f"prompts: {{source: {prompts}}}\n")
    spec = importlib.util.spec_from_file_location("bench_cli", ROOT / "05_benchmark.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    with _StandIn(speculative=True) as s:
        rc = cli.main(["--config", str(cfg), "--server", s.url, "--datasets", str(prompts), "--max-new-tokens", "6"])
        sent = [r["input_ids"] for r in s.requests[1:]]
    assert rc == 0
    want = [render(smollm_tokenizer, [{"role": "user", "content": t}], add_generation_prompt=True) for t in ("Hello there", "Bye")]
    assert sent == want
    rep = json.loads((tmp_path / "out" / "bench" / "server_bench.json").read_text())
    assert rep["dataset"] == "p" and rep["servers"][0]["completion_tokens"] == 12
