"""05 --server against a stand-in vLLM server answering like vLLM 0.32's OpenAI server.

The stand-in copies the endpoints 05 reads: ``GET /v1/models`` (``ModelCard``: ``owned_by: "vllm"``, ``root`` = the
model given to ``vllm serve``), ``/version``, ``/metrics`` (the Prometheus counters of
``vllm/v1/spec_decode/metrics.py``: ``vllm:spec_decode_num_drafts_total``, ``_num_draft_tokens_total``,
``_num_accepted_tokens_total`` and ``_num_accepted_tokens_per_pos_total{position="k"}``, labelled by engine and model),
``/server_info?config_format=json`` only in dev mode (``VLLM_SERVER_DEV_MODE=1``: ``vllm_config.speculative_config``
with ``method``, ``model``, ``num_speculative_tokens``) and ``POST /v1/completions`` (``prompt`` as ids,
``return_token_ids``: ``choices[0].token_ids``, ``usage.completion_tokens``). Its drafts follow
``test_server_bench._accepts`` (the first token from the prefill, then ``a`` accepted drafts + 1 per verify step).
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from test_server_bench import PROMPTS, STEPS, _accepts, _bench_cli

from eagle3.decoding.server import bench_server, detect_engine, server_info
from eagle3.decoding.server_checks import check_speculative_algorithm, draft_folder_warnings
from eagle3.decoding.server_vllm import counters_delta, vllm_counters
from eagle3.errors import UserError


def _count(c: dict, ids: list[int], max_new: int) -> dict:
    """Add one request's verify steps to the counts ``c`` as vLLM counts them (per position: every position up to
    the last accepted one); returns ``c``."""
    n, accepts = 1, _accepts(ids, False)
    while n < max_new:
        a = next(accepts)
        c["drafts"] += 1
        c["draft_tokens"] += STEPS
        c["accepted"] += a
        for k in range(a):
            c["per_pos"][k] += 1
        n += a + 1
    return c


def _fresh() -> dict:
    return {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": [0] * STEPS}


class _VllmStandIn:
    def __init__(
        self,
        speculative: bool = True,
        dev_mode: bool = True,
        method: str = "eagle3",
        draft: str | None = "/nodes/node1/drafter-vllm",
        model: str = "/models/verifier",
        other_client_drafts: int = 0,
    ):
        """``dev_mode``: ``/server_info`` answers (else 404, vLLM's default); ``method`` / ``draft``: its
        ``speculative_config``; ``model``: the model it serves (``/v1/models`` ``root``); ``other_client_drafts``:
        verify steps (none accepted) another client adds with each request."""
        self.speculative = speculative
        self.requests: list[dict] = []
        self.counts = _fresh()
        outer = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, code: int, body: bytes, ctype: str = "application/json"):
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if self.path == "/v1/models":
                    card = {"id": model, "object": "model", "owned_by": "vllm", "root": model}
                    self._send(200, json.dumps({"object": "list", "data": [card]}).encode())
                elif self.path == "/version":
                    self._send(200, b'{"version": "0.32.0"}')
                elif self.path == "/metrics":
                    self._send(200, outer.metrics().encode(), "text/plain; version=0.0.4")
                elif self.path == "/server_info?config_format=json" and dev_mode:
                    spec = {"method": method, "model": draft, "num_speculative_tokens": STEPS}
                    conf = {
                        "model_config": {"model": model},
                        "speculative_config": spec if speculative else None,
                    }
                    self._send(200, json.dumps({"vllm_config": conf, "vllm_env": {}}).encode())
                else:
                    self._send(404, b'{"detail": "Not Found"}')

            def do_POST(self):
                req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append(req)
                if self.path != "/v1/completions":
                    self._send(404, b'{"detail": "Not Found"}')
                    return
                ids, n = req["prompt"], req["max_tokens"]
                if speculative:
                    outer.decode(ids, n)
                    outer.counts["drafts"] += other_client_drafts
                    outer.counts["draft_tokens"] += STEPS * other_client_drafts
                out = [(sum(ids) + i) % 1000 for i in range(n)]
                choice = {"index": 0, "text": " ".join(map(str, out)), "finish_reason": "length"}
                if req.get("return_token_ids"):
                    choice["token_ids"] = out
                usage = {
                    "prompt_tokens": len(ids),
                    "completion_tokens": n,
                    "total_tokens": len(ids) + n,
                }
                self._send(200, json.dumps({"choices": [choice], "usage": usage}).encode())

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def decode(self, ids: list[int], max_new: int) -> None:
        _count(self.counts, ids, max_new)

    def metrics(self) -> str:
        """``/metrics`` as vLLM writes it: HELP / TYPE lines, ``_total`` and ``_created`` samples, other metrics."""
        if not self.speculative:
            return '# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine="0"} 0.0\n'
        lab = 'engine="0",model_name="/models/verifier"'
        c = self.counts
        lines = ["# HELP vllm:spec_decode_num_drafts Number of spec decoding drafts."]
        for name, key in (
            ("drafts", "drafts"),
            ("draft_tokens", "draft_tokens"),
            ("accepted_tokens", "accepted"),
        ):
            lines += [
                f"# TYPE vllm:spec_decode_num_{name} counter",
                f"vllm:spec_decode_num_{name}_total{{{lab}}} {float(c[key])}",
                f"vllm:spec_decode_num_{name}_created{{{lab}}} 1.79e+09",
            ]
        for k, v in enumerate(c["per_pos"]):
            lines.append(
                f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{lab},position="{k}"}} {float(v)}'
            )
        lines.append('vllm:num_requests_running{engine="0"} 0.0')
        return "\n".join(lines) + "\n"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


#: the stand-in's counts for PROMPTS at max_new_tokens 10 (``_accepts``: L=3 accepts 3, 1, 3; L=5 1 x 5; L=6 2, 1, 2,
#: 1): 12 verify steps, 18 accepted drafts, per position [3 + 5 + 4, 2 + 0 + 2, 2 + 0 + 0]
DRAFTS, ACCEPTED, PER_POS = 12, 18, [12, 4, 2]


def test_vllm_server_is_told_apart_from_sglang_by_its_model_cards():
    from test_server_bench import _StandIn

    with _VllmStandIn() as v, _StandIn(speculative=True) as s:
        assert (detect_engine(v.url), detect_engine(s.url)) == ("vllm", "sglang")


def test_vllm_counters_parse_prometheus_text_summed_over_engines(monkeypatch):
    """Two engines (data parallel) and two series per counter: summed; ``_created`` samples and other metrics are not
    counts; a delta is per key and per position."""
    from eagle3.decoding import server_vllm as srv

    text = "\n".join(
        [
            "# HELP vllm:spec_decode_num_drafts Number of spec decoding drafts.",
            "# TYPE vllm:spec_decode_num_drafts counter",
            'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 7.0',
            'vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 5.0',
            'vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.7966e+09',
            'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 36.0',
            'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 9.0',
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 2.0',
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 6.0',
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="m",position="0"} 1.0',
            'vllm:spec_decode_num_accepted_tokens_per_pos_created{engine="0",model_name="m",position="0"} 1.7e+09',
            'vllm:num_requests_running{engine="0"} 3.0',
        ]
    )
    monkeypatch.setattr(srv, "request_text", lambda *a, **k: text)
    now = vllm_counters("http://x")
    assert now == {
        "present": True,
        "drafts": 12,
        "draft_tokens": 36,
        "accepted": 9,
        "accepted_per_pos": [7, 2],
    }
    earlier = {
        "present": True,
        "drafts": 2,
        "draft_tokens": 6,
        "accepted": 1,
        "accepted_per_pos": [1],
    }
    assert counters_delta(earlier, now) == {
        "present": True,
        "drafts": 10,
        "draft_tokens": 30,
        "accepted": 8,
        "accepted_per_pos": [6, 2],
    }
    monkeypatch.setattr(
        srv, "request_text", lambda *a, **k: 'vllm:num_requests_running{engine="0"} 0.0\n'
    )
    assert vllm_counters("http://x") == {
        "present": False,
        "drafts": 0,
        "draft_tokens": 0,
        "accepted": 0,
        "accepted_per_pos": [],
    }


@pytest.mark.parametrize("concurrency", [1, 3])
def test_bench_server_reads_taus_from_the_counters_around_the_run(concurrency):
    """tau, per-position rates and the histogram from the /metrics deltas after the warm-up: the warm-up request's
    drafts (prompt a at 8 tokens: 3 verify steps) are not in them."""
    with _VllmStandIn() as s:
        res = bench_server(s.url, PROMPTS, 10, concurrency=concurrency, progress=False)
        sent = s.requests
    assert len(sent) == 1 + len(PROMPTS) and sent[1]["prompt"] in [ids for _, ids in PROMPTS]
    assert {k: sent[1][k] for k in ("max_tokens", "temperature", "return_token_ids")} == {
        "max_tokens": 10,
        "temperature": 0,
        "return_token_ids": True,
    }
    assert res["engine"] == "vllm" and res["speculative"] and res["steps"] == STEPS
    assert (res["verify_steps"], res["accepted_drafts"], res["draft_tokens"]) == (
        DRAFTS,
        ACCEPTED,
        3 * DRAFTS,
    )
    assert res["accepted_per_pos"] == PER_POS
    assert res["tau"] == pytest.approx(1 + ACCEPTED / DRAFTS)
    # reach >= 0: 12, >= 1: 12, >= 2: 4, >= 3: 2 -> exactly 0: 0, 1: 8, 2: 2, 3: 2
    assert res["accepted_hist"] == [0, 8, 2, 2]
    assert res["conditional"] == pytest.approx([12 / 12, 4 / 12, 2 / 4])
    assert res["unconditional"] == pytest.approx([1, 4 / 12, 2 / 12])
    assert res["tau"] == pytest.approx(1 + sum(res["unconditional"]))
    assert res["completion_tokens"] == 30 and res["warnings"] == []
    # one request in flight: each row holds its own counts (the deltas around it), summing to the run's
    own = [_count(_fresh(), ids, 10) for _, ids in PROMPTS]
    rows = [
        {k: r.get(k) for k in ("verify_steps", "accepted_drafts", "accepted_per_pos")}
        for r in res["per_request"]
    ]
    assert rows == (
        [
            {
                "verify_steps": c["drafts"],
                "accepted_drafts": c["accepted"],
                "accepted_per_pos": c["per_pos"],
            }
            for c in own
        ]
        if concurrency == 1
        else [dict.fromkeys(rows[0])] * len(PROMPTS)
    )
    assert [r["output_ids"] for r in res["per_request"]] == [
        [(sum(ids) + i) % 1000 for i in range(10)] for _, ids in PROMPTS
    ]
    assert res["server_info"] == {
        "engine": "vllm",
        "server_info": True,
        "model_path": "/models/verifier",
        "version": "0.32.0",
        "speculative_algorithm": "eagle3",
        "speculative_draft_model_path": "/nodes/node1/drafter-vllm",
        "speculative_num_steps": STEPS,
        "steps_from": "/server_info",
    }


def test_without_dev_mode_the_steps_come_from_the_per_position_counters():
    with _VllmStandIn(dev_mode=False) as s:
        info = server_info(s.url)
    assert info == {
        "engine": "vllm",
        "server_info": False,
        "model_path": "/models/verifier",
        "version": "0.32.0",
        "speculative_num_steps": STEPS,
        "steps_from": "/metrics",
    }


def test_another_clients_drafts_in_the_counters_are_warned_about():
    """Every verify step emits at least one token: more verify steps than this run's tokens after the first means
    another client's requests ran meanwhile (their drafts are in tau)."""
    with _VllmStandIn(other_client_drafts=10) as s:
        res = bench_server(s.url, PROMPTS, 10, progress=False)
    assert res["verify_steps"] == DRAFTS + 30 and res["tau"] == pytest.approx(
        1 + ACCEPTED / (DRAFTS + 30)
    )
    assert res["warnings"] == [
        f"{s.url}/metrics counted 42 verify steps while this run's requests emitted 27 tokens after their first: "
        "another client's requests ran on the server meanwhile and their drafts are in tau; benchmark a server no "
        "one else uses"
    ]


def test_a_plain_vllm_server_is_not_speculative(caplog):
    import logging

    from eagle3.decoding.server import run_server_bench

    with _VllmStandIn(speculative=False) as s, caplog.at_level(logging.WARNING):
        rep = run_server_bench([s.url], PROMPTS, 10, progress=False)
    assert rep["engine"] == "vllm" and not rep["servers"][0]["speculative"]
    assert "tau" not in rep["servers"][0]
    assert caplog.messages == [
        f"server {s.url} counted no drafts at /metrics (vllm:spec_decode_num_drafts): was it started with "
        '--speculative-config \'{"method": "eagle3", ...}\' and without --disable-log-stats?'
    ]


def _export(tmp_path, engine: str) -> Path:
    from test_export import LLAMA30, drafter

    from eagle3.export.writer import export_drafter

    out = tmp_path / f"drafter-{engine}"
    return export_drafter(drafter(), out, engine, [2, 15, 27], LLAMA30, ttt_length=STEPS)


def test_the_eagle_method_is_refused_naming_the_export_and_the_relaunch_flag(tmp_path):
    """vLLM's ``method: eagle`` (and SGLang's EAGLE / NEXTN) serve an EAGLE-3 drafter without its aux hidden states,
    without an error (tau ~1.0): one line names the server's method, the export's and the flag to relaunch with."""
    from test_server_bench import _StandIn

    vl = _export(tmp_path, "vllm")
    with _VllmStandIn(method="eagle", draft=str(vl)) as s:
        with pytest.raises(UserError) as e:
            check_speculative_algorithm(s.url, server_info(s.url))
    assert str(e.value) == (
        f"{s.url}/server_info speculative_config.method is 'eagle', but the export {vl} (method eagle3, variant "
        f"eagle3) needs 'eagle3' (vLLM's eagle path captures no aux hidden states: tau ~1.0); restart the server "
        f'with --speculative-config \'{{"method": "eagle3", "model": "{vl}", '
        f'"num_speculative_tokens": {STEPS}}}\''
    )
    # the server's draft folder not readable here: the run's export names the method
    with _VllmStandIn(method="eagle", draft="/nodes/node1/drafter-vllm") as s:
        with pytest.raises(UserError) as e:
            check_speculative_algorithm(s.url, server_info(s.url), vl)
    assert f"but the export {vl} (method eagle3, variant eagle3) needs 'eagle3'" in str(e.value)
    assert '"model": "/nodes/node1/drafter-vllm"' in str(e.value)
    sg = _export(tmp_path, "sglang")
    for algo in ("EAGLE", "NEXTN", "eagle"):
        with _StandIn(speculative=True, algorithm=algo, draft=str(sg)) as s:
            with pytest.raises(UserError) as e:
                check_speculative_algorithm(s.url, server_info(s.url))
        assert str(e.value) == (
            f"{s.url}/server_info speculative_algorithm is {algo!r}, but the export {sg} (method eagle3, variant "
            f"eagle3) needs 'EAGLE3' (SGLang's {algo} path captures no aux hidden states: tau ~1.0); restart the "
            f"server with --speculative-algorithm EAGLE3"
        )
    # eagle3 / EAGLE3, plain servers and servers that do not say: not refused
    for kw in ({}, {"speculative": False}, {"dev_mode": False}):
        with _VllmStandIn(**kw) as s:
            assert check_speculative_algorithm(s.url, server_info(s.url), vl) is None
    with _StandIn(speculative=True, algorithm="EAGLE3") as s:
        assert check_speculative_algorithm(s.url, server_info(s.url), sg) is None


def test_vllm_draft_folder_checks(tmp_path):
    """The draft folder vLLM names (dev mode) is checked as SGLang's: an SGLang-format folder (which vLLM 0.32 loads
    without a word, one layer off) is refused; num_speculative_tokens past the trained ttt_length is warned; without
    dev mode nothing is known of the folder and one line says what was not checked and how to check it."""
    sg = _export(tmp_path, "sglang")
    with _VllmStandIn(draft=str(sg)) as s:
        with pytest.raises(UserError, match="this folder is for sglang, but vllm serves it"):
            draft_folder_warnings(s.url, "tiny/llama-30", None, tmp_path / "no-shards")
    vl = _export(tmp_path, "vllm")
    meta = json.loads((vl / "eagle3_train.json").read_text())
    (vl / "eagle3_train.json").write_text(json.dumps({**meta, "ttt_length": STEPS - 1}))
    with _VllmStandIn(draft=str(vl)) as s:
        lines, rec = draft_folder_warnings(s.url, "tiny/llama-30", None, tmp_path / "no-shards")
    assert rec["engine"] == "vllm" and rec["readable"] and rec["speculative_num_steps"] == STEPS
    assert any(
        f"the server's num_speculative_tokens (--speculative-config, {s.url}/server_info)" in w
        and "restart the server with num_speculative_tokens 2 in --speculative-config" in w
        for w in lines
    ), lines
    with _VllmStandIn(dev_mode=False) as s:
        lines, rec = draft_folder_warnings(s.url, "tiny/llama-30", None, tmp_path)
    assert (
        lines
        == rec["not_checked"]
        == [
            f"{s.url}/server_info did not answer (vLLM serves it only when started with VLLM_SERVER_DEV_MODE=1), so "
            "the server's speculative method and draft folder are unknown: 05 did not check it against the server "
            f"(its method against eagle3, its eagle3_train.json ttt_length against num_speculative_tokens {STEPS}, its "
            "config.json's engine (vllm) and aux layers against the shards'); start the server with "
            "VLLM_SERVER_DEV_MODE=1 and run 05 where its draft folder is readable, or check that its "
            "--speculative-config has method eagle3, a drafter-vllm folder and num_speculative_tokens at most that "
            "folder's eagle3_train.json ttt_length"
        ]
    )
    for dev_mode in (
        True,
        False,
    ):  # a plain server: nothing to say (run_server_bench says it did not draft)
        with _VllmStandIn(speculative=False, dev_mode=dev_mode) as s:
            assert draft_folder_warnings(s.url, "x", None, tmp_path)[0] == []


def test_cli_server_mode_against_vllm(tmp_path, tiny_llama_dir):
    """05 --server on a vLLM server: the prompts as token ids to /v1/completions, tau from /metrics, the served model
    (/v1/models root) compared with verifier.path, a vLLM report title."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt": f"Hello {i}"}) + "\n" for i in "xyz"))
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        f"run_name: t\noutput_root: {tmp_path / 'out'}\nverifier: {{path: {tiny_llama_dir}}}\n"
        f"prompts: {{source: {prompts}}}\n"
    )
    with _VllmStandIn(model=str(tiny_llama_dir), dev_mode=False) as s:
        rc = _bench_cli().main(
            ["--config", str(cfg), "--server", s.url, "--datasets", str(prompts)]
            + ["--max-new-tokens", "10"]
        )
        sent = [r["prompt"] for r in s.requests[1:]]
        total = s.counts
    assert (
        rc == 0 and len(sent) == 3 and s.requests[0]["prompt"] == sent[0]
    )  # the warm-up: the first prompt
    rep = json.loads((tmp_path / "out" / "bench" / "server_bench.json").read_text())
    srv = rep["servers"][0]
    want = _fresh()
    for ids in sent:
        _count(want, ids, 10)
    assert (
        _count(_fresh(), sent[0], 8)["drafts"] + want["drafts"] == total["drafts"]
    )  # the warm-up left out
    assert (srv["verify_steps"], srv["accepted_drafts"], srv["accepted_per_pos"]) == (
        want["drafts"],
        want["accepted"],
        want["per_pos"],
    )
    assert srv["tau"] == pytest.approx(1 + want["accepted"] / want["drafts"])
    assert rep["served_model"][0]["match"] == "same folder"
    assert rep["served_model"][0]["endpoint"] == "/v1/models"
    assert rep["draft_folder"]["engine"] == "vllm" and not rep["draft_folder"]["readable"]
    md = (tmp_path / "out" / "bench" / "server_bench.md").read_text()
    assert (
        md.startswith("# vLLM server benchmark (p, 3 prompts")
        and "vLLM's spec-decode counters" in md
    )


def test_the_readme_vllm_serve_commands_pass_05s_checks():
    """Each ``--speculative-config`` README.md gives vLLM, served by the stand-in, is one 05 --server accepts:
    method eagle3 (never the eagle path that drops the aux states), a drafter-vllm folder, the benchmark's 3 steps."""
    import re

    from conftest import ROOT

    configs = re.findall(r"--speculative-config '(\{[^']*\})'", (ROOT / "README.md").read_text())
    assert len(configs) >= 2  # the demo's and Kimi's
    for c in map(json.loads, configs):
        assert (Path(c["model"]).name, c["num_speculative_tokens"]) == ("drafter-vllm", STEPS)
        with _VllmStandIn(method=c["method"], draft=c["model"]) as s:
            info = server_info(s.url)
            assert info["speculative_algorithm"] == "eagle3"
            assert check_speculative_algorithm(s.url, info) is None


def test_a_served_drafter_other_than_the_runs_export_is_said(tmp_path):
    """The folder the server names against the run's export of the same engine: a copy passes (recorded), other
    weights are one warning line; an export for the other engine is not compared."""
    import shutil

    from test_export import LLAMA30, drafter

    from eagle3.export.writer import export_drafter

    mine = _export(tmp_path, "vllm")
    copy = tmp_path / "copy" / "drafter-vllm"
    shutil.copytree(mine, copy)
    other = export_drafter(
        drafter(seed=1), tmp_path / "other", "vllm", [2, 15, 27], LLAMA30, ttt_length=STEPS
    )
    sg = _export(tmp_path, "sglang")
    for served, export, same in ((copy, mine, True), (other, mine, False), (other, sg, None)):
        with _VllmStandIn(draft=str(served)) as s:
            lines, rec = draft_folder_warnings(
                s.url, "tiny/llama-30", None, tmp_path / "no-shards", export_dir=export
            )
        assert rec.get("same_weights_as_export") is same
        said = [w for w in lines if "holds other weights than the run's export" in w]
        assert said == (
            []
            if same is not False
            else [
                f"{s.url}: the server's draft folder {other} holds other weights than the run's export {mine} "
                f"({other / 'model.safetensors'} and {mine / 'model.safetensors'} differ): 05 measures the served "
                f"drafter, not this run's; serve {mine}, or check that {other} is the drafter you mean to measure"
            ]
        )


@pytest.mark.parametrize(
    "engine, answer",
    [
        ("sglang", {"text": "x"}),
        ("sglang", [{"meta_info": {"completion_tokens": "3"}}]),
        ("sglang", []),
        ("vllm", {"usage": {"completion_tokens": 3}, "choices": []}),
        ("vllm", {"choices": [{"text": "x"}]}),
        ("vllm", ["no"]),
    ],
)
def test_an_answer_without_the_engines_counts_is_one_line_naming_the_engine(
    monkeypatch, engine, answer
):
    """:func:`eagle3.decoding.server_vllm.require_answer` owns the refusal of both engines' completion answers."""
    from eagle3.decoding import server, server_vllm

    mod = server if engine == "sglang" else server_vllm
    monkeypatch.setattr(mod, "http_json", lambda *a, **k: answer)
    url = "http://127.0.0.1:1"
    with pytest.raises(UserError) as e:
        (server.generate if engine == "sglang" else server_vllm.vllm_generate)(url, [1, 2], 4)
    assert str(e.value) == (
        f"server {url}: /generate response has no meta_info.completion_tokens (is this SGLang?)"
        if engine == "sglang"
        else f"server {url}: /v1/completions response has no usage.completion_tokens or choices "
        f"(is this vLLM?)"
    )


def test_an_answer_with_the_engines_counts_is_read_as_sent(monkeypatch):
    from eagle3.decoding import server, server_vllm

    meta = {"completion_tokens": 3, "spec_verify_ct": 2}
    monkeypatch.setattr(server, "http_json", lambda *a, **k: [{"meta_info": meta, "text": "t"}])
    got = server.generate("http://h", [1], 4)
    assert got["meta_info"] == meta and got["text"] == "t"
    answer = {"usage": {"completion_tokens": 2}, "choices": [{"token_ids": [5, 6], "text": "ab"}]}
    monkeypatch.setattr(server_vllm, "http_json", lambda *a, **k: answer)
    got = server_vllm.vllm_generate("http://h", [1], 4)
    assert got["meta_info"]["completion_tokens"] == 2 and got["output_ids"] == [5, 6]
