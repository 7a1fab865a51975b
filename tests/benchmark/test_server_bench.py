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
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from eagle3.decoding.server import (
    bench_server,
    emitted_histogram,
    generate,
    run_server_bench,
    server_info,
)
from eagle3.errors import UserError

STEPS = 3


def _accepts(input_ids: list[int], oracle: bool):
    """Accepted drafts per verify step: every draft (oracle) or, for a prompt of length L, L % 4 then 1, repeated."""
    while True:
        if oracle:
            yield STEPS
        else:
            yield len(input_ids) % 4
            yield 1


def _answer(input_ids: list[int], max_new: int, speculative: bool, oracle: bool = False) -> dict:
    """Deterministic fake decode: output = (sum(prompt) + i) % 1000.

    Speculative answers count like SGLang 0.5.23: the first token comes from the prefill, each
    verify step adds its accepted drafts + 1, and the histogram / correct-draft counters record
    the verifier's whole decision BEFORE ``output_ids`` are cut at ``max_new_tokens``.
    """
    out = [(sum(input_ids) + i) % 1000 for i in range(max_new)]
    meta = {
        "id": "r",
        "finish_reason": {"type": "length", "length": max_new},
        "prompt_tokens": len(input_ids),
        "weight_version": "default",
        "num_retractions": 0,
        "reasoning_tokens": 0,
        "completion_tokens": max_new,
        "cached_tokens": 0,
        "e2e_latency": 0.01,
    }
    if speculative:
        hist = [0] * (STEPS + 1)
        n, verify = 1, 0
        accepts = _accepts(input_ids, oracle)
        while n < max_new:
            a = next(accepts)
            hist[a] += 1
            verify += 1
            n += a + 1
        correct = sum(a * c for a, c in enumerate(hist))
        meta.update(
            {
                "spec_accept_rate": correct / (verify * STEPS),
                "spec_accept_length": max_new / verify,
                "spec_num_correct_drafts": correct,
                "spec_num_proposed_drafts": verify * STEPS,
                "spec_verify_ct": verify,
                "spec_correct_drafts_histogram": hist,
            }
        )
    return {"text": " ".join(map(str, out)), "output_ids": out, "meta_info": meta}


class _StandIn:
    def __init__(
        self,
        speculative: bool,
        fail: bool = False,
        oracle: bool = False,
        draft: str | None = None,
        delay: float = 0.0,
        model: str | None = "tiny",
        has_info: bool = True,
        info_steps=STEPS,
        algorithm: str = "EAGLE3",
    ):
        """``draft``: the ``speculative_draft_model_path`` its ``/server_info`` names (absent: None); ``delay``:
        seconds each ``/generate`` answer waits (a slowed server); ``model``: its ``--model-path``, named by
        ``/server_info`` and ``/model_info`` as SGLang 0.5.23 does (None: neither names one); ``has_info`` False: no
        ``/server_info`` (404), as an older server; ``info_steps``: its ``speculative_num_steps`` when speculative."""
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
                if (
                    self.path == "/model_info" and model is not None
                ):  # SGLang 0.5.23 (/get_model_info before 0.5)
                    self._send(
                        200,
                        {
                            "model_path": model,
                            "tokenizer_path": model,
                            "is_generation": True,
                            "architectures": ["LlamaForCausalLM"],
                        },
                    )
                elif self.path == "/server_info" and has_info:
                    info = {
                        "speculative_algorithm": algorithm if speculative else None,
                        "speculative_num_steps": info_steps if speculative else None,
                        "speculative_eagle_topk": 1,
                        "speculative_num_draft_tokens": STEPS + 1,
                        "unrelated": 1,
                    }
                    if model is not None:
                        info["model_path"] = model
                    if draft is not None:
                        info["speculative_draft_model_path"] = draft
                    self._send(200, info)
                else:
                    self._send(404, {"detail": "Not Found"})

            def do_POST(self):
                req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append(req)
                if fail or self.path != "/generate":
                    self._send(
                        400,
                        {"error": {"message": "bad request body", "type": "invalid_request_error"}},
                    )
                    return
                sp = req["sampling_params"]
                time.sleep(delay)
                self._send(
                    200, _answer(req["input_ids"], sp["max_new_tokens"], speculative, oracle)
                )

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
        assert s.requests[-1] == {
            "input_ids": [1, 2, 3],
            "sampling_params": {"temperature": 0, "max_new_tokens": 9},
        }
    assert r["output_ids"] == [(6 + i) % 1000 for i in range(9)]
    assert r["meta_info"]["completion_tokens"] == 9 and r["seconds"] > 0


@pytest.mark.parametrize("concurrency", [1, 3])
def test_bench_server_pools_tau_and_histogram(concurrency):
    with _StandIn(speculative=True) as s:
        res = bench_server(s.url, PROMPTS, 10, concurrency=concurrency, progress=False)
        assert len(s.requests) == 1 + len(PROMPTS)  # warm-up + one per prompt
    # hand-computed from the stand-in's rule (max_new 10, first token from the prefill):
    # L=3: accepts 3,1,3 -> 1+4+2+4 = 11, last step emits 3 of 4: reported [0,1,0,2], emitted [0,1,1,1]
    # L=5: accepts 1,1,1,1,1 -> 1+2*5 = 11, last emits 1 of 2:      reported [0,5,0,0], emitted [1,4,0,0]
    # L=6: accepts 2,1,2,1 -> 1+3+2+3+2 = 11, last emits 1 of 2:    reported [0,2,2,0], emitted [0,3,1,0]
    #      (buckets 1 and 2 both hold the excess with 2 counts each: the tie takes bucket 2; the
    #      true last step was in bucket 1, which would give [1,1,2,0]: same emitted total and tau)
    metas = [_answer(ids, 10, True)["meta_info"] for _, ids in PROMPTS]
    assert [m["spec_correct_drafts_histogram"] for m in metas] == [
        [0, 1, 0, 2],
        [0, 5, 0, 0],
        [0, 2, 2, 0],
    ]
    assert [r["emitted_histogram"] for r in res["per_request"]] == [
        [0, 1, 1, 1],
        [1, 4, 0, 0],
        [0, 3, 1, 0],
    ]
    assert res["histogram_trims"] == {"exact": 1, "ambiguous": 2, "inconsistent": 0}
    assert res["reported_accepted_hist"] == [0, 8, 2, 2]
    assert res["accepted_hist"] == [1, 8, 2, 1]
    assert res["speculative"] and res["steps"] == STEPS
    assert res["completion_tokens"] == 30 and res["verify_steps"] == 12
    assert res["tau"] == pytest.approx(27 / 12)  # 9 tokens per request come from verify steps
    assert res["sglang_accept_length"] == pytest.approx(30 / 12)
    # reach >=0: 12, >=1: 11, >=2: 3, >=3: 1
    assert res["conditional"] == pytest.approx([11 / 12, 3 / 11, 1 / 3])
    assert res["unconditional"] == pytest.approx([11 / 12, 3 / 12, 1 / 12])
    assert res["tau"] == pytest.approx(1 + sum(res["unconditional"]))
    assert res["mean_spec_accept_length"] == pytest.approx((10 / 3 + 10 / 5 + 10 / 4) / 3)
    assert res["server_info"] == {
        "model_path": "tiny",
        "speculative_algorithm": "EAGLE3",
        "speculative_num_steps": 3,
        "speculative_eagle_topk": 1,
        "speculative_num_draft_tokens": 4,
    }
    assert [r["id"] for r in res["per_request"]] == [
        "a",
        "b",
        "c",
    ]  # request order kept under concurrency
    assert res["output_tokens_per_s"] == pytest.approx(30 / res["wall_seconds"])


def test_oracle_drafter_tau_counts_only_emitted_tokens():
    """Issue 11 item 2: a drafter that always proposes the verifier's own tokens, 3 steps,
    max_new_tokens 10. SGLang reports histogram [0,0,0,3] (12 tokens' worth) for 3 verify steps
    that emitted 1+4+4+1... = 9 tokens after the prefill token: tau 3.0, not 4.0."""
    with _StandIn(speculative=True, oracle=True) as s:
        res = bench_server(s.url, [("a", [1, 2, 3])], 10, progress=False)
    assert res["reported_accepted_hist"] == [0, 0, 0, 3]
    assert res["accepted_hist"] == [1, 0, 0, 2]
    assert res["histogram_trims"] == {"exact": 1, "ambiguous": 0, "inconsistent": 0}
    assert res["verify_steps"] == 3 and res["tau"] == pytest.approx(3.0)
    assert res["sglang_accept_length"] == pytest.approx(10 / 3)
    assert res["conditional"] == pytest.approx([2 / 3, 1.0, 1.0])
    assert res["unconditional"] == pytest.approx([2 / 3, 2 / 3, 2 / 3])


def test_emitted_histogram_cases():
    assert emitted_histogram([0, 0, 0, 3], 10, 3) == ([1, 0, 0, 2], "exact")
    assert emitted_histogram([0, 0, 0, 3], 13, 3) == ([0, 0, 0, 3], "exact")  # nothing cut
    assert emitted_histogram([0, 0, 0, 3], 12, 3) == (
        [0, 0, 1, 2],
        "exact",
    )  # EOS inside the last step
    assert emitted_histogram([2, 1], 5, 3) == ([2, 1], "exact")  # 1 (prefill) + 1 + 1 + 2
    assert emitted_histogram([5], 2, 5) == (
        [5],
        "inconsistent",
    )  # implies 5 tokens, 1 emitted by verify
    assert emitted_histogram([1, 0, 1], 9, 2) == ([1, 0, 1], "inconsistent")  # implies 4, emitted 8
    assert emitted_histogram([], 1, 0) == ([], "exact")


def test_two_servers_speedup_and_reports(tmp_path):
    with _StandIn(speculative=True) as spec, _StandIn(speculative=False) as base:
        rep = run_server_bench(
            [spec.url, base.url],
            PROMPTS,
            8,
            concurrency=2,
            dataset="mtbench",
            out_dir=tmp_path,
            progress=False,
            extra={"prompt_pick": "first", "warnings": ["mtbench: the 3 prompts ... (x)"]},
        )
    a, b = rep["servers"]
    assert a["speculative"] and not b["speculative"] and "tau" not in b
    assert rep["speedup"] == pytest.approx(a["output_tokens_per_s"] / b["output_tokens_per_s"])
    assert rep["identical_outputs"] == 3
    saved = json.loads((tmp_path / "server_bench.json").read_text())
    assert saved["servers"][0]["tau"] == pytest.approx(a["tau"])
    md = (tmp_path / "server_bench.md").read_text()
    assert f"| {spec.url} | yes | {a['tau']:.2f} |" in md and f"| {base.url} | no | n/a |" in md
    assert "identical outputs: 3/3" in md
    assert "prompts picked: first" in md and "Warning: mtbench: the 3 prompts ... (x)" in md
    assert saved["prompt_pick"] == "first"
    assert (tmp_path / "server_acceptance.png").read_bytes()[:4] == b"\x89PNG"


def test_a_speedup_above_tau_against_a_slowed_baseline_server_is_flagged(tmp_path, caplog):
    """A baseline server slowed by 0.2 s a request gives a speedup far above the speculative server's tau, which chain
    speculative decoding cannot reach on the same hardware: one warning line, logged, in server_bench.json/.md."""
    import logging

    from eagle3.decoding.metrics import speedup_warning

    with (
        _StandIn(speculative=True) as spec,
        _StandIn(speculative=False, delay=0.2) as base,
        caplog.at_level(logging.WARNING),
    ):
        rep = run_server_bench(
            [spec.url, base.url],
            PROMPTS,
            8,
            dataset="mtbench",
            out_dir=tmp_path,
            progress=False,
            extra={"warnings": ["w0"]},
        )
    tau = rep["servers"][0]["tau"]
    assert rep["speedup"] > 1.05 * tau  # 3 x 0.2 s against a few ms
    want = speedup_warning("mtbench", rep["speedup"], tau, baseline="the baseline server")
    assert want.startswith(
        f"mtbench: speedup {rep['speedup']:.2f}x is above tau {tau:.2f}, which chain speculative"
    )
    assert "no cheaper than the baseline server's one-token forward" in want
    assert rep["warnings"] == ["w0", want] and caplog.messages.count(want) == 1
    assert json.loads((tmp_path / "server_bench.json").read_text())["warnings"] == ["w0", want]
    assert f"Warning: {want}" in (tmp_path / "server_bench.md").read_text()


def test_a_plain_server_run_removes_the_plot_of_an_earlier_run(tmp_path):
    """server_bench.{json,md} and server_acceptance.png are written as one set: a run against a server without
    EAGLE-3 statistics writes no plot, and the plot an earlier speculative run left (its tau) is removed rather than
    kept beside the new report (trial 2026-12-05g)."""
    with _StandIn(speculative=True) as spec:
        run_server_bench(
            [spec.url], PROMPTS, 8, dataset="mtbench", out_dir=tmp_path, progress=False
        )
    assert (tmp_path / "server_acceptance.png").is_file()
    with _StandIn(speculative=False) as base:
        rep = run_server_bench(
            [base.url], PROMPTS, 8, dataset="mtbench", out_dir=tmp_path, progress=False
        )
    assert not rep["servers"][0]["speculative"]
    assert json.loads((tmp_path / "server_bench.json").read_text())["servers"][0]["url"] == base.url
    assert sorted(p.name for p in tmp_path.iterdir()) == ["server_bench.json", "server_bench.md"]


def test_server_errors_are_user_errors(tmp_path):
    with _StandIn(speculative=True, fail=True) as s:
        with pytest.raises(UserError, match=r"HTTP 400: .*bad request body"):
            generate(s.url, [1], 4)
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    with pytest.raises(
        UserError, match=r"^server http://127\.0\.0\.1:\d+/generate: cannot connect"
    ):  # --server or the config
        generate(f"http://127.0.0.1:{port}", [1], 4, timeout=5)
    with pytest.raises(UserError, match="1 or 2 URLs"):
        run_server_bench([], PROMPTS, 4)


def _bench_cli():
    """05_benchmark.py loaded as a module (its main(argv) runs in-process)."""
    import importlib.util

    from conftest import ROOT

    spec = importlib.util.spec_from_file_location("bench_cli", ROOT / "05_benchmark.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    return cli


def test_cli_server_mode_sends_chat_rendered_prompts(tmp_path, tiny_llama_dir, smollm_tokenizer):
    from eagle3.chat.template import render

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        json.dumps({"id": "x", "prompt": "Hello there"})
        + "\n"
        + json.dumps({"id": "y", "prompt": "Bye"})
        + "\n"
    )
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        f"run_name: t\noutput_root: {tmp_path / 'out'}\nverifier: {{path: {tiny_llama_dir}}}\n"
        f"prompts: {{source: {prompts}}}\n"
    )
    cli = _bench_cli()
    with _StandIn(speculative=True, model=str(tiny_llama_dir)) as s:
        rc = cli.main(
            [
                "--config",
                str(cfg),
                "--server",
                s.url,
                "--datasets",
                str(prompts),
                "--max-new-tokens",
                "6",
            ]
        )
        sent = [r["input_ids"] for r in s.requests[1:]]
    assert rc == 0
    want = [
        render(smollm_tokenizer, [{"role": "user", "content": t}], add_generation_prompt=True)
        for t in ("Hello there", "Bye")
    ]
    assert sent == want
    rep = json.loads((tmp_path / "out" / "bench" / "server_bench.json").read_text())
    assert rep["dataset"] == "p" and rep["servers"][0]["completion_tokens"] == 12


def _unchecked(rep: dict) -> list[str]:
    """The lines of a 05 --server report saying which checks were not made (``not_checked``: those of ``draft_folder``
    and ``served_model``, then the chat template's), each also one of its ``warnings``."""
    parts = rep["draft_folder"]["not_checked"] + [
        w for r in rep["served_model"] for w in r["not_checked"]
    ]
    assert rep["not_checked"][: len(parts)] == parts and len(rep["not_checked"]) <= len(parts) + 1
    return rep["not_checked"]


def _draft_dir(tmp_path, ttt_length: int = STEPS) -> str:
    """A readable draft folder for a speculative stand-in (SGLang's /server_info always names its
    speculative_draft_model_path): ``eagle3_train.json`` with ``ttt_length``."""
    draft = tmp_path / "drafter"
    draft.mkdir(exist_ok=True)
    (draft / "eagle3_train.json").write_text(json.dumps({"ttt_length": ttt_length}))
    return str(draft)


def test_cli_server_mode_from_the_config(tmp_path, tiny_llama_dir):
    """benchmark.server_urls alone puts 05 in server mode (configs/kimi-k2.5.yaml relies on it: it was ignored and 05
    ran the in-process benchmark), on the config's benchmark.datasets; --server overrides the config's URLs."""
    sets = []
    for name in ("p", "q"):
        sets.append(tmp_path / f"{name}.jsonl")
        sets[-1].write_text(json.dumps({"id": "x", "prompt": f"Hello {name}"}) + "\n")
    cli = _bench_cli()
    with (
        _StandIn(speculative=True, model=str(tiny_llama_dir), draft=_draft_dir(tmp_path)) as s,
        _StandIn(speculative=True, model=str(tiny_llama_dir), draft=_draft_dir(tmp_path)) as other,
    ):
        cfg = tmp_path / "run.yaml"
        cfg.write_text(
            f"run_name: t\noutput_root: {tmp_path / 'out'}\nverifier: {{path: {tiny_llama_dir}}}\n"
            f"prompts: {{source: {sets[0]}}}\n"
            f"benchmark: {{server_urls: [{s.url}], datasets: [{sets[0]}, {sets[1]}], max_new_tokens: 4}}\n"
        )
        assert cli.main(["--config", str(cfg)]) == 0
        assert (
            len([r for r in s.requests if "input_ids" in r]) == 4
        )  # per set: a warm-up request and its prompt
        for name in ("p", "q"):
            rep = json.loads(
                (tmp_path / "out" / "bench" / f"server-{name}" / "server_bench.json").read_text()
            )
            assert rep["dataset"] == name and rep["servers"][0]["url"] == s.url
            assert (rep["prompt_pick"], rep["prompt_ids"], rep["warnings"]) == (
                "first",
                ["x"],
                _unchecked(rep),
            )
        assert (
            cli.main(["--config", str(cfg), "--server", other.url, "--datasets", str(sets[1])]) == 0
        )
        assert len([r for r in other.requests if "input_ids" in r]) == 2
        assert (
            len([r for r in s.requests if "input_ids" in r]) == 4
        )  # the config's server not asked again
        # two prompt files of the same name in different folders: two reports, not one overwriting the other
        (tmp_path / "d1").mkdir()
        (tmp_path / "d2").mkdir()
        for d in ("d1", "d2"):
            (tmp_path / d / "two.jsonl").write_text(
                json.dumps({"id": d, "prompt": f"Hi {d}"}) + "\n"
            )
        assert (
            cli.main(
                [
                    "--config",
                    str(cfg),
                    "--datasets",
                    str(tmp_path / "d1" / "two.jsonl"),
                    str(tmp_path / "d2" / "two.jsonl"),
                ]
            )
            == 0
        )
        for d in ("d1", "d2"):
            rep = json.loads(
                (tmp_path / "out" / "bench" / f"server-{d}_two" / "server_bench.json").read_text()
            )
            assert rep["dataset"] == f"{d}/two"


def test_stale_server_reports_are_named(tmp_path):
    """A one-set 05 --server run writes bench/server_bench.json and a several-set run bench/server-{set}/: the
    reports an earlier run left in the other layout are not rewritten, so each is named in a warning with its set."""
    from eagle3.decoding.server import report_dirs, stale_server_reports

    bench = tmp_path / "bench"
    assert report_dirs(bench, ["mtbench"]) == [bench]
    assert report_dirs(bench, ["mtbench", "d1/two"]) == [
        bench / "server-mtbench",
        bench / "server-d1_two",
    ]
    assert stale_server_reports(bench, ["mtbench"]) == []  # nothing there yet
    for d, name in (
        (bench, "gsm8k"),
        (bench / "server-mtbench", "mtbench"),
        (bench / "server-humaneval", "humaneval"),
    ):
        d.mkdir(parents=True, exist_ok=True)
        (d / "server_bench.json").write_text(json.dumps({"dataset": name}))
    got = stale_server_reports(
        bench, ["mtbench", "gsm8k"]
    )  # several sets: the top-level one and humaneval's are old
    assert got == [
        f"{bench / 'server_bench.json'}: a server report of an earlier run (set gsm8k), not rewritten by "
        f"this one; this run writes {bench / 'server-gsm8k' / 'server_bench.json'}, "
        f"{bench / 'server-mtbench' / 'server_bench.json'}",
        f"{bench / 'server-humaneval' / 'server_bench.json'}: a server report of an earlier run (set "
        f"humaneval), not rewritten by this one; this run writes {bench / 'server-gsm8k' / 'server_bench.json'}, "
        f"{bench / 'server-mtbench' / 'server_bench.json'}",
    ]
    one = stale_server_reports(
        bench, ["gsm8k"]
    )  # one set: the folders of both earlier sets are old
    assert [w.split(":")[0] for w in one] == [
        str(bench / "server-humaneval" / "server_bench.json"),
        str(bench / "server-mtbench" / "server_bench.json"),
    ]
    (bench / "server-humaneval" / "server_bench.json").write_text("{not json")
    assert "(set ?)" in stale_server_reports(bench, ["gsm8k"])[0]  # unreadable: still named


def test_cli_server_mode_prints_each_report_and_warns_on_too_few_prompts(
    tmp_path, tiny_llama_dir, capsys, caplog
):
    """05 --server prints a ``report:`` line per report written (bench/server-{set}/server_bench.md with several sets,
    as offline prints bench.md), and --num-prompts above a set's size is warned about (log and server_bench.json)."""
    import logging

    sets = []
    for name, n in (("p", 2), ("q", 1)):
        sets.append(tmp_path / f"{name}.jsonl")
        sets[-1].write_text(
            "".join(
                json.dumps({"id": f"{name}{i}", "prompt": f"Hello {i}"}) + "\n" for i in range(n)
            )
        )
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        f"run_name: t\noutput_root: {tmp_path / 'out'}\nverifier: {{path: {tiny_llama_dir}}}\n"
        f"prompts: {{source: {sets[0]}}}\n"
    )
    cli = _bench_cli()
    bench = tmp_path / "out" / "bench"
    with (
        _StandIn(speculative=True, model=str(tiny_llama_dir), draft=_draft_dir(tmp_path)) as s,
        caplog.at_level(logging.WARNING),
    ):
        assert (
            cli.main(
                [
                    "--config",
                    str(cfg),
                    "--server",
                    s.url,
                    "--datasets",
                    str(sets[0]),
                    str(sets[1]),
                    "--num-prompts",
                    "2",
                    "--max-new-tokens",
                    "4",
                ]
            )
            == 0
        )
        lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("report: ")]
        assert lines == [
            f"report: {bench / 'server-p' / 'server_bench.md'}",
            f"report: {bench / 'server-q' / 'server_bench.md'}",
        ]
        want = "q: 2 prompts asked (--num-prompts / benchmark.num_prompts) but the set has 1: all 1 benchmarked"
        assert caplog.messages.count(want) == 1  # p has exactly 2: nothing said
        rep = json.loads((bench / "server-q" / "server_bench.json").read_text())
        assert rep["warnings"] == _unchecked(rep) + [want] and rep["prompt_ids"] == ["q0"]
        rep = json.loads((bench / "server-p" / "server_bench.json").read_text())
        assert rep["warnings"] == _unchecked(rep)
        assert (
            cli.main(
                [
                    "--config",
                    str(cfg),
                    "--server",
                    s.url,
                    "--datasets",
                    str(sets[1]),
                    "--max-new-tokens",
                    "4",
                ]
            )
            == 0
        )
        out = capsys.readouterr().out.splitlines()
        assert [ln for ln in out if ln.startswith("report: ")] == [
            f"report: {bench / 'server_bench.md'}"
        ]


def test_cli_server_mode_warns_when_the_server_drafts_past_the_trained_ttt_length(
    tmp_path, tiny_llama_dir, caplog
):
    """05 --server against a server drafting 3 tokens a step (--speculative-num-steps 3) with a drafter trained for 2
    (its eagle3_train.json ttt_length) said nothing, where 05 offline warns: one line now names both values and where
    each comes from, in the log and in server_bench.json; a drafter trained for 3 is not warned about."""
    import logging

    draft = tmp_path / "drafter"
    draft.mkdir()
    (draft / "eagle3_train.json").write_text(json.dumps({"ttt_length": 2}))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "x", "prompt": "Hello"}) + "\n")
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        f"run_name: t\noutput_root: {tmp_path / 'out'}\nverifier: {{path: {tiny_llama_dir}}}\n"
        f"prompts: {{source: {prompts}}}\n"
    )
    cli = _bench_cli()
    report = tmp_path / "out" / "bench" / "server_bench.json"
    with (
        _StandIn(speculative=True, model=str(tiny_llama_dir), draft=str(draft)) as s,
        caplog.at_level(logging.WARNING),
    ):
        assert (
            cli.main(
                [
                    "--config",
                    str(cfg),
                    "--server",
                    s.url,
                    "--datasets",
                    str(prompts),
                    "--max-new-tokens",
                    "4",
                ]
            )
            == 0
        )
        field = f"the server's speculative_num_steps (--speculative-num-steps, {s.url}/server_info)"
    want = (
        f"{field} 3 drafts more tokens a step than the drafter was trained for: {draft / 'eagle3_train.json'} "
        f"records ttt_length 2 (train.ttt_length); position 3 was never trained, so the acceptance there is low "
        f"and tau understates a 2-step chain: restart the server with --speculative-num-steps 2, or train with "
        f"train.ttt_length 3"
    )
    assert caplog.messages.count(want) == 1
    rep = json.loads(report.read_text())
    assert rep["warnings"] == [want] + _unchecked(rep)
    (draft / "eagle3_train.json").write_text(json.dumps({"ttt_length": 3}))
    caplog.clear()
    with (
        _StandIn(speculative=True, model=str(tiny_llama_dir), draft=str(draft)) as s,
        caplog.at_level(logging.WARNING),
    ):
        assert (
            cli.main(
                [
                    "--config",
                    str(cfg),
                    "--server",
                    s.url,
                    "--datasets",
                    str(prompts),
                    "--max-new-tokens",
                    "4",
                ]
            )
            == 0
        )
    assert not [m for m in caplog.messages if "drafts more tokens" in m]
    rep = json.loads(report.read_text())
    assert rep["warnings"] == _unchecked(rep)


def test_cli_server_mode_says_when_the_draft_folder_cannot_be_read(
    tmp_path, tiny_llama_dir, caplog
):
    """05 --server checked the drafter's ttt_length (and the folder's engine and aux layers) against the server only
    when the folder its /server_info names was readable here, and skipped them without a word otherwise (a server on
    another host). One warning line now says what was not checked and how to check it, in the log and in
    server_bench.json (``warnings``, and ``draft_folder`` with ``readable: false``); a server that names no folder
    gets the same line, a readable folder none, with what its missing files left unchecked in ``not_checked``. Without
    the run's shards the chat template is not checked either: one more line."""
    import logging

    from transformers import AutoTokenizer

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "x", "prompt": "Hello"}) + "\n")
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        f"run_name: t\noutput_root: {tmp_path / 'out'}\nverifier: {{path: {tiny_llama_dir}}}\n"
        f"prompts: {{source: {prompts}}}\n"
    )
    cli = _bench_cli()
    report = tmp_path / "out" / "bench" / "server_bench.json"
    gone = "/nodes/node1/drafter-sglang"
    from eagle3.chat.template import chat_template_hash

    tpl = (
        f"{tmp_path / 'out' / 'shards' / 'data_config.json'} not found: 05 did not check that the prompts it renders "
        f"with the chat template of tokenizer '{tiny_llama_dir}', sha256 "
        f"{chat_template_hash(AutoTokenizer.from_pretrained(tiny_llama_dir))[:12]} are in the template the "
        f"drafter's data was rendered with; check verifier.chat_template against the template the shards were made "
        f"with"
    )
    tail = (
        f": 05 did not check it against the server (its eagle3_train.json ttt_length against "
        f"--speculative-num-steps {STEPS}, its config.json's engine (sglang) and aux layers against the shards'); "
        f"run 05 where that folder is readable (e.g. on shared storage), or check there that its eagle3_train.json "
        f"has engine sglang and ttt_length >= the server's --speculative-num-steps"
    )
    for draft in (gone, None):
        caplog.clear()
        with (
            _StandIn(speculative=True, model=str(tiny_llama_dir), draft=draft) as s,
            caplog.at_level(logging.WARNING),
        ):
            assert (
                cli.main(
                    [
                        "--config",
                        str(cfg),
                        "--server",
                        s.url,
                        "--datasets",
                        str(prompts),
                        "--max-new-tokens",
                        "4",
                    ]
                )
                == 0
            )
            want = (
                f"the server's draft folder {gone} ({s.url}/server_info speculative_draft_model_path) is not "
                f"readable on this machine (the server runs elsewhere, or it is a hub id)"
                if draft
                else f"{s.url}/server_info names no speculative_draft_model_path"
            ) + tail
            url = s.url
        assert caplog.messages.count(want) == 1
        rep = json.loads(report.read_text())
        assert (
            rep["warnings"] == [want, tpl] == rep["not_checked"]
        )  # tpl: no shards here, so no template check
        assert rep["draft_folder"] == {
            "url": url,
            "engine": "sglang",
            "path": draft,
            "speculative_num_steps": STEPS,
            "readable": False,
            "not_checked": [want],
        }
    caplog.clear()
    with (
        _StandIn(speculative=True, model=str(tiny_llama_dir), draft=_draft_dir(tmp_path)) as s,
        caplog.at_level(logging.WARNING),
    ):
        assert (
            cli.main(
                [
                    "--config",
                    str(cfg),
                    "--server",
                    s.url,
                    "--datasets",
                    str(prompts),
                    "--max-new-tokens",
                    "4",
                ]
            )
            == 0
        )
    rep = json.loads(report.read_text())
    assert rep["draft_folder"]["readable"] is True
    want = [
        f"{tmp_path / 'drafter' / 'eagle3_train.json'} names no verifier: 05 did not check that the drafter was "
        f"trained for the verifier '{tiny_llama_dir}' (name, dimensions, weights); check which verifier its "
        f"training used",
        f"{tmp_path / 'drafter' / 'config.json'} not found: 05 did not check the folder's engine and aux layers; "
        f"check that the server loads a folder with one",
    ]
    assert rep["draft_folder"]["not_checked"] == want and rep["warnings"] == want + [
        tpl
    ]  # a warning now, as offline
    assert caplog.messages.count(want[0]) == caplog.messages.count(want[1]) == 1


def test_served_model_is_compared_with_the_configured_verifier(
    tmp_path, tiny_llama_dir, other_weights_dir
):
    """05 --server renders the prompts with verifier.path's tokenizer and chat template but never compared the
    server's model_path with it: a server of another model gave a tau of nothing, without a word. Now each server's
    model_path (/server_info, else /model_info) is compared: the same folder or a copy of its weights passes;
    other weights are warned about; a name that cannot be confirmed, or no model_path at all, is said in one line
    (not_checked) naming what to check."""
    import shutil

    from eagle3.config import VerifierConfig
    from eagle3.decoding.server_checks import served_model_warnings

    cfg = type("Cfg", (), {"verifier": VerifierConfig(path=str(tiny_llama_dir))})()
    copy = tmp_path / "copy"
    shutil.copytree(tiny_llama_dir, copy)
    tail = (
        f"05 renders the prompts with the tokenizer and chat template of verifier '{tiny_llama_dir}' "
        f"({tiny_llama_dir})"
    )
    for model, has_info, match in (
        (str(tiny_llama_dir), True, "same folder"),
        (str(copy), True, "same weights"),
        (f"org/{tiny_llama_dir.name}", False, "same name"),
    ):
        with _StandIn(speculative=True, model=model, has_info=has_info) as s:
            w, (rec,) = served_model_warnings(cfg.verifier, [s.url])
        assert w == [] and rec == {
            "url": s.url,
            "model_path": model,
            "verifier": str(tiny_llama_dir),
            "match": match,
            "endpoint": "/server_info" if has_info else "/model_info",
            "not_checked": [],
        }
    with (
        _StandIn(speculative=True, model=str(other_weights_dir)) as s,
        _StandIn(speculative=False, model=None) as b,
    ):
        w, (rec, base) = served_model_warnings(cfg.verifier, [s.url, b.url])
    assert w[0] == (
        f"{s.url}/server_info model_path {other_weights_dir} is not the configured verifier: its weight "
        f"files are not those at verifier.path (verifier_weights fingerprints differ); {tail}, so tau "
        f"measures a server of another model: benchmark a server started with --model-path "
        f"{tiny_llama_dir}, or set verifier.path to the served model"
    )
    assert rec["match"] == "differs" and rec["not_checked"] == []
    assert (
        base
        == {
            "url": b.url,
            "model_path": None,
            "endpoint": None,
            "verifier": str(tiny_llama_dir),
            "match": None,
            "not_checked": [w[1]],
        }
        and len(w) == 2
    )
    assert w[1] == (
        f"{b.url}: none of /server_info, /model_info, /get_model_info names the served model_path (not "
        f"SGLang?): 05 did not check that the server runs the configured verifier; {tail}: check that "
        f"the server was started with --model-path {tiny_llama_dir}"
    )
    with _StandIn(speculative=True, model="moonshotai/Kimi-K2.5") as s:
        w, (rec,) = served_model_warnings(cfg.verifier, [s.url])
    assert rec["match"] is None and rec["not_checked"] == w == [
        f"{s.url}/server_info model_path moonshotai/Kimi-K2.5: it is not readable on this machine and its name "
        f"'Kimi-K2.5' is not verifier.path's ({tiny_llama_dir.name.lower()}), so 05 could not check that the server "
        f"runs the configured verifier; {tail}: check that the server's --model-path holds the model at "
        f"{tiny_llama_dir}"
    ]


def test_cli_server_mode_warns_when_the_server_runs_another_model(
    tmp_path, tiny_llama_dir, other_weights_dir, caplog
):
    """The served-model check end to end: 05 --server against a server started with another model's weights logs one
    warning line and records it in server_bench.json (``warnings``, ``served_model``); the run still completes."""
    import logging

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "x", "prompt": "Hello"}) + "\n")
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        f"run_name: t\noutput_root: {tmp_path / 'out'}\nverifier: {{path: {tiny_llama_dir}}}\n"
        f"prompts: {{source: {prompts}}}\n"
    )
    with (
        _StandIn(speculative=True, model=str(other_weights_dir), draft=_draft_dir(tmp_path)) as s,
        caplog.at_level(logging.WARNING),
    ):
        assert (
            _bench_cli().main(
                [
                    "--config",
                    str(cfg),
                    "--server",
                    s.url,
                    "--datasets",
                    str(prompts),
                    "--max-new-tokens",
                    "4",
                ]
            )
            == 0
        )
    rep = json.loads((tmp_path / "out" / "bench" / "server_bench.json").read_text())
    (w,) = [w for w in rep["warnings"] if "is not the configured verifier" in w]
    assert w.startswith(
        f"{s.url}/server_info model_path {other_weights_dir} is not the configured verifier"
    )
    assert caplog.messages.count(w) == 1
    assert rep["served_model"] == [
        {
            "url": s.url,
            "model_path": str(other_weights_dir),
            "endpoint": "/server_info",
            "verifier": str(tiny_llama_dir),
            "match": "differs",
            "not_checked": [],
        }
    ]


def test_server_info_naming_a_draft_folder_that_is_not_a_string_is_said():
    """A ``/server_info`` whose ``speculative_draft_model_path`` is not a string (``5``, ``["a"]``: a proxy in front
    of SGLang, a hand-made stand-in) stopped 05 --server in ``TypeError: expected str, bytes or os.PathLike object``;
    it is now the draft-folder line saying the folder was not checked, with the value as found."""
    from eagle3.decoding.server_checks import draft_folder_warnings

    for bad in (5, ["a"]):
        with _StandIn(speculative=True, draft=bad) as s:
            lines, rec = draft_folder_warnings(s.url, "v", None, Path("."))
        assert lines == rec["not_checked"] and len(lines) == 1
        assert lines[0].startswith(
            f"{s.url}/server_info speculative_draft_model_path is {bad!r}, not a folder path: "
            f"05 did not check it against the server (its eagle3_train.json ttt_length against "
            f"--speculative-num-steps {STEPS}, "
        )
        assert rec["readable"] is False and rec["path"] == bad


def test_server_info_speculative_num_steps_that_is_not_an_integer_falls_back_to_the_histogram():
    """A ``/server_info`` whose ``speculative_num_steps`` is not an integer (``"three"``, ``true``, ``0``) stopped 05
    --server in ``ValueError: invalid literal for int()`` after the whole measurement (or took ``true`` as 1 draft
    step); the steps now come from the drafts histogram, as for a server that names none."""
    for odd in ("three", True, 0):
        with _StandIn(speculative=True, info_steps=odd) as s:
            res = bench_server(s.url, PROMPTS, 10, concurrency=1, progress=False)
        assert res["steps"] == STEPS and len(res["conditional"]) == STEPS, odd


def test_a_server_running_the_eagle_algorithm_is_refused_by_name(tmp_path):
    """An SGLang server started with ``--speculative-algorithm EAGLE`` (not EAGLE3) serves an EAGLE-3 drafter with
    no aux hidden states (tau ~1.0, no error): 05 --server's checks refuse it in one line naming the server and the
    fix (no export folder readable: "an EAGLE-3 drafter"; with one, test_vllm_server names it); EAGLE3 and a plain
    server pass the check."""
    from eagle3.decoding.server_checks import check_speculative_algorithm

    for algo in ("EAGLE", "eagle"):
        with _StandIn(speculative=True, algorithm=algo) as s:
            with pytest.raises(UserError) as e:
                check_speculative_algorithm(s.url, server_info(s.url))
        assert str(e.value) == (
            f"{s.url}/server_info speculative_algorithm is {algo!r}, but an EAGLE-3 drafter needs 'EAGLE3' "
            f"(SGLang's {algo} path captures no aux hidden states: tau ~1.0); restart the server with "
            "--speculative-algorithm EAGLE3"
        )
    for spec in (True, False):
        with _StandIn(speculative=spec) as s:
            assert check_speculative_algorithm(s.url, server_info(s.url)) is None
    assert check_speculative_algorithm("http://x", {}) is None
