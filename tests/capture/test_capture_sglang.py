"""SGLangCapture end to end against a local stand-in of the patched SGLang server (HTTP in a thread).

The stand-in answers SGLang 0.5.23's endpoints (``/model_info``, ``/server_info``, ``/generate`` with
the same request/response fields) and writes the capture files with the patch's own code
(``patches/eagle3_capture.py``: ``record_capture_layers`` at start-up, ``store_prefill_capture`` per
request, fed with a packed ``[T, 3H]`` aux buffer and ``[T, H]`` last states like SGLang's logits
processor leaves them). The "verifier" is a seeded embedding table, so expected tensors are exact.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest
import torch
from conftest import ROOT

from eagle3.capture.base import CaptureBackend, check_captured
from eagle3.capture.sglang import SGLangCapture
from eagle3.errors import UserError

sys.path.insert(0, str(ROOT / "patches"))
import eagle3_capture as ec  # noqa: E402

H, V = (
    8,
    49152,
)  # V = SmolLM2's vocab, so real tokenizer ids can be captured (tests/capture/test_capture_multi.py)
EMB = torch.randn(V, H, generator=torch.Generator().manual_seed(0))  # [V, H] the stand-in verifier
# The patch finds its folder through the environment (one server per process in production); stand-ins
# sharing this process each set it under this lock while they write.
_PATCH_LOCK = threading.Lock()


def expected(ids: list[int]) -> list[torch.Tensor]:
    """What the stand-in verifier captures: aux_k = emb * (k + 1), last = emb * 10 (bf16 [L, H])."""
    h = EMB[torch.tensor(ids)]  # [L, H]
    return [(h * (k + 1)).to(torch.bfloat16) for k in range(3)] + [(h * 10).to(torch.bfloat16)]


class StandIn:
    """Behaviour switches of the stand-in server."""

    def __init__(self, capture_dir):
        self.capture_dir = capture_dir
        self.arch = "DeepseekV3ForCausalLM"
        self.layers = [3, 31, 59]
        self.server = {
            "version": "0.5.23",
            "disable_radix_cache": True,
            "enable_return_aux_hidden_states": True,
            "chunked_prefill_size": -1,
        }
        self.mode = "ok"  # ok | drop_token | alter_token | cached | unpatched | partial | no_file
        self.posts: list[dict] = []
        # fail every /generate from the fail_after-th one on (0-based count of requests received):
        # "500" answers HTTP 500, "refuse" drops that request's connection and shuts the server down
        self.fail_after: int | None = None
        self.fail_mode = "500"
        self.received = 0  # /generate requests that arrived (counted on arrival, under _PATCH_LOCK)

    def start_model(self):
        """Like SGLang's model runner after configure_aux_hidden_state_capture (patched): capture_info.json."""
        model = SimpleNamespace(
            model=SimpleNamespace(layers_to_capture=list(self.layers)),
            config=SimpleNamespace(num_hidden_layers=61, hidden_size=H, vocab_size=V),
        )
        with _PATCH_LOCK:
            os.environ[ec.ENV_DIR] = str(self.capture_dir)
            ec.record_capture_layers(model)

    def generate(self, body: dict) -> list[dict]:
        with _PATCH_LOCK:
            os.environ[ec.ENV_DIR] = str(self.capture_dir)
            ec._STATE["layers"] = list(self.layers)
            return self._generate(body)

    def _generate(self, body: dict) -> list[dict]:
        self.posts.append(body)
        batch, rids = body["input_ids"], body["rid"]
        assert body["return_hidden_states"] is True
        assert body["sampling_params"] == {"max_new_tokens": 1, "temperature": 0.0}
        prefilled = [ids[:-1] if self.mode == "drop_token" else ids for ids in batch]
        if self.mode == "alter_token":
            prefilled = [[(ids[0] + 1) % V] + ids[1:] for ids in batch]
        # one packed prefill buffer for the whole batch, as the logits processor returns it
        states = [expected(ids) for ids in prefilled]
        aux = torch.cat([torch.cat(s[:3], dim=-1) for s in states])  # [T, 3H]
        last = torch.cat([s[3] for s in states])  # [T, H]
        lo = SimpleNamespace(hidden_states=aux, last_hidden_states=last)
        off = 0
        out = []
        for rid, ids in zip(rids, prefilled):
            req = SimpleNamespace(
                rid=rid, origin_input_ids=ids, return_hidden_states=True, hidden_states=[]
            )
            n = len(ids) - (1 if self.mode == "partial" else 0)
            if self.mode == "unpatched":
                req.hidden_states.append(aux[off : off + n].tolist())
                off += n
            elif self.mode == "no_file":
                off += n
            else:
                off = ec.store_prefill_capture(
                    req=req, logits_output=lo, start=off, extend_input_len=n, store=True
                )
            out.append(
                {
                    "text": "x",
                    "output_ids": [1],
                    "meta_info": {
                        "id": rid,
                        "finish_reason": {"type": "length", "length": 1},
                        "prompt_tokens": len(ids),
                        "completion_tokens": 1,
                        "cached_tokens": 2 if self.mode == "cached" else 0,
                        "hidden_states": req.hidden_states,
                    },
                }
            )
        return out


@pytest.fixture()
def server(tmp_path, monkeypatch):
    cap = tmp_path / "capture"
    cap.mkdir()
    monkeypatch.setenv(ec.ENV_DIR, str(cap))
    monkeypatch.setitem(ec._STATE, "layers", None)
    st = StandIn(cap)
    st.start_model()
    httpd = serve(st)
    yield st
    httpd.shutdown()
    httpd.server_close()


def serve(st: StandIn) -> ThreadingHTTPServer:
    """Serve ``st`` over HTTP on a free local port in a thread; sets ``st.url``. Stop: ``shutdown()`` + ``server_close()``."""
    failed = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _send(self, code, obj):
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/model_info":
                self._send(
                    200,
                    {"model_path": "/models/x", "architectures": [st.arch], "is_generation": True},
                )
            elif self.path == "/server_info":
                self._send(200, dict(st.server))
            else:
                self._send(404, {"detail": "Not Found"})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path != "/generate":
                return self._send(404, {"detail": "Not Found"})
            with _PATCH_LOCK:
                n = st.received
                st.received += 1
            if st.fail_after is not None and n >= st.fail_after:
                st.posts.append(body)
                if st.fail_mode == "500":
                    return self._send(
                        500, {"detail": "CUDA error: an illegal memory access was encountered"}
                    )
                self.close_connection = (
                    True  # "refuse": no answer to this one, nothing listening afterwards
                )
                if not failed.is_set():
                    failed.set()
                    threading.Thread(
                        target=lambda: (httpd.shutdown(), httpd.server_close()), daemon=True
                    ).start()
                return
            self._send(200, st.generate(body))

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    st.url = f"http://127.0.0.1:{httpd.server_address[1]}"
    return httpd


def _backend(st, **kw):
    return SGLangCapture(
        url=st.url, capture_dir=st.capture_dir, aux_layers=[3, 31, 59], timeout=30, **kw
    )


def test_end_to_end(server):
    be = _backend(server, max_length=4096)
    assert isinstance(be, CaptureBackend)
    assert be.info() == {
        "num_layers": 61,
        "hidden_size": H,
        "vocab_size": V,
        "architecture": "DeepseekV3ForCausalLM",
        "last_hidden_state": "post_norm",
    }
    batch = [[5, 6, 7, 8, 9], [1], [60, 61, 62, 63, 0, 2, 4]]
    out = be.capture(batch)
    assert len(out) == 3
    for ids, states in zip(batch, out):
        check_captured(ids, states, H, "test")
        for got, want in zip(states, expected(ids)):
            assert torch.equal(got, want)
    # files consumed: only capture_info.json remains; rids are unique and safe file names
    assert [p.name for p in server.capture_dir.iterdir()] == [ec.INFO_FILE]
    rids = server.posts[0]["rid"]
    assert len(set(rids)) == 3 and all(ec.RID_RE.match(r) for r in rids)
    assert be.capture([]) == []


def test_aux_layers_none_takes_the_servers(server):
    be = SGLangCapture(url=server.url, capture_dir=server.capture_dir, aux_layers=None)
    assert be.aux_layers is None
    be.info()
    assert be.aux_layers == [3, 31, 59]


def test_max_requests_splits_posts(server):
    be = _backend(server, max_requests=2)
    out = be.capture([[1, 2], [3], [4, 5, 6]])
    assert [len(p["input_ids"]) for p in server.posts] == [2, 1]
    assert torch.equal(out[2][3], expected([4, 5, 6])[3])


@pytest.mark.parametrize(
    "mode, match",
    [
        ("drop_token", "server counted 1 prompt tokens, 2 were sent"),
        (
            "alter_token",
            r"field 'input_ids' holds 2 ids: the server prefilled different token ids than were sent \(first mismatch at position 0\)",
        ),
        (
            "cached",
            "cached_tokens' is 2: prompt tokens came from the prefix cache; relaunch the server with --disable-radix-cache",
        ),
        ("unpatched", "not running the capture patch"),
        ("partial", "prefill covered 1 of 2 prompt tokens"),
        ("no_file", r"\.pt: not written by the server"),
    ],
)
def test_server_misbehaviour_is_user_error(server, mode, match):
    server.mode = mode
    be = _backend(server)
    with pytest.raises(UserError, match=match):
        be.capture([[7, 8]])
    assert [p.name for p in server.capture_dir.iterdir()] == [ec.INFO_FILE]  # nothing left behind


def test_layer_mismatch_names_the_fix(server):
    server.layers = [2, 30, 58]
    server.start_model()
    with pytest.raises(
        UserError,
        match=r"captures HF layers \[2, 30, 58\] .* --return-aux-hidden-state-layer-ids 3 31 59",
    ):
        _backend(server).info()
    server.arch = "LlamaForCausalLM"  # Llama rule: SGLang adds +1, so the flag must say i - 1
    with pytest.raises(UserError, match="--return-aux-hidden-state-layer-ids 2 30 58"):
        _backend(server).info()


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("disable_radix_cache", False, "radix cache is on"),
        ("enable_return_aux_hidden_states", False, "--enable-return-aux-hidden-states"),
        (
            "chunked_prefill_size",
            2048,
            "chunked_prefill_size' is 2048: relaunch with --chunked-prefill-size -1",
        ),
        # at least max_length is not enough: the chunk budget is shared by a prefill batch's prompts (trial 05e)
        (
            "chunked_prefill_size",
            8192,
            "chunked_prefill_size' is 8192: relaunch with --chunked-prefill-size -1",
        ),
        ("version", "0.5.24", "SGLang 0.5.24; the capture patch is for 0.5.23"),
    ],
)
def test_server_flags_checked(server, key, value, match):
    server.server[key] = value
    with pytest.raises(UserError, match=match):
        _backend(server, max_length=4096).info()


def test_unreachable_and_missing_info(tmp_path, server):
    with pytest.raises(UserError, match="server not reachable"):
        SGLangCapture(
            url="http://127.0.0.1:9", capture_dir=tmp_path, aux_layers=[3, 31, 59], timeout=5
        ).info()
    with pytest.raises(UserError, match="extract.capture_dir: .* is not a folder"):
        SGLangCapture(url=server.url, capture_dir=tmp_path / "nope", aux_layers=[3, 31, 59])
    other = tmp_path / "other"
    other.mkdir()
    with pytest.raises(UserError, match="capture_info.json: not found"):
        SGLangCapture(url=server.url, capture_dir=other, aux_layers=[3, 31, 59]).info()


def test_the_last_hidden_state_convention_is_not_assumed_silently(server, caplog):
    """capture_info.json without last_hidden_state (a patch of before the key) was taken as post_norm without a word,
    and each capture file's own record of it was never compared: 04 applies the final norm (or not) by it. Now the
    default is one warning line, and a capture file whose convention differs from capture_info.json's is refused."""
    import json
    import logging

    info = server.capture_dir / ec.INFO_FILE
    cap = json.loads(info.read_text())
    assert cap["last_hidden_state"] == "post_norm"  # what the patch writes
    info.write_text(json.dumps({k: v for k, v in cap.items() if k != "last_hidden_state"}))
    with caplog.at_level(logging.WARNING, logger="eagle3.capture.sglang"):
        assert _backend(server).info()["last_hidden_state"] == "post_norm"
    assert caplog.messages == [
        f"{info}: no last_hidden_state recorded (a capture patch of before the key?): taking post_norm, the state "
        f"SGLang's last_hidden_states holds after the final norm, unchecked; run the server with this checkout's "
        f"patches/sglang_capture_launcher.py, which records it"
    ]
    info.write_text(json.dumps({**cap, "last_hidden_state": "pre_norm"}))  # the files say post_norm
    be = _backend(server)
    assert be.info()["last_hidden_state"] == "pre_norm"
    with pytest.raises(
        UserError,
        match=r"field 'last_hidden_state' is 'post_norm', but capture_info.json says 'pre_norm'",
    ):
        be.capture([[5, 6, 7]])
    info.write_text(json.dumps({**cap, "last_hidden_state": "final"}))
    with pytest.raises(
        UserError,
        match=r"capture_info.json: field 'last_hidden_state' should be 'post_norm' or 'pre_norm', got 'final'",
    ):
        _backend(server).info()


def test_the_files_the_server_writes_are_refused_absent_in_their_own_words(tmp_path, server):
    """SGLangCapture._written owns 'the patched server wrote its file in capture_dir': capture_info.json at
    start-up, {rid}.pt per request; each absence is its own line."""
    other = tmp_path / "other"
    other.mkdir()
    with pytest.raises(UserError) as e:
        SGLangCapture(url=server.url, capture_dir=other, aux_layers=[3, 31, 59]).info()
    assert str(e.value) == (
        f"{other / ec.INFO_FILE}: not found; is the server running patches/sglang_capture_launcher.py with "
        "this --capture-dir, on this host?"
    )
    server.mode = "no_file"
    be = _backend(server)
    with pytest.raises(UserError) as e:
        be.capture([[7, 8]])
    rid = server.posts[-1]["rid"][0]
    assert str(e.value) == (
        f"{server.capture_dir / (rid + '.pt')}: not written by the server (wrong --capture-dir, another host, "
        "or the patch is not active)"
    )


def test_an_answer_unlike_the_request_is_refused_before_any_file_is_read():
    """sglang._unlike_sent owns 'the /generate answer is one result per request id sent, each counting its
    prompt's tokens': the first difference is the line, None when the answer is exact."""
    from eagle3.capture.sglang import GenerateResult, _unlike_sent

    def res(rid, n):
        return GenerateResult.model_validate({"meta_info": {"id": rid, "prompt_tokens": n}})

    where, batch = "extract.sglang_url http://h/generate", [[1, 2], [3, 4, 5]]
    assert _unlike_sent([res("a", 2), res("b", 3)], ["a", "b"], batch, where) is None
    assert _unlike_sent([res("a", 2)], ["a", "b"], batch, where) == (
        f"{where}: expected one result per request id sent (2), got 1 results with 1 of the ids"
    )
    assert _unlike_sent([res("a", 2), res("c", 3)], ["a", "b"], batch, where) == (
        f"{where}: expected one result per request id sent (2), got 2 results with 1 of the ids"
    )
    assert _unlike_sent([res("a", 2), res("b", 2)], ["a", "b"], batch, where) == (
        f"{where} rid b: server counted 2 prompt tokens, 3 were sent"
    )
