"""The SGLang 0.5.23 capture patch (patches/): writer, launcher glue, diff, checked against the installed source.

SGLang is installed without dependencies (``pip install --no-deps sglang==0.5.23``), so ``import sglang``
fails (orjson, fastapi, CUDA kernels...). What runs here:
- SGLang's REAL code, compiled function by function from the installed files (patches/sglang_source.py):
  ``SchedulerBatchResultProcessor._append_prefill_hidden_states`` (the original the patch wraps),
  ``GenerationBatchResult.copy_to_cpu``, ``configure_aux_hidden_state_capture``,
  ``DeepseekV2ForCausalLM/LlamaForCausalLM.set_eagle3_layers_to_capture``, ``CaptureHiddenMode``, and the
  whole ``srt/layers/aux_hidden_states.py`` module (``AuxHiddenStatePacker``, ``pack_aux_hidden_states``).
- Stand-ins for what needs a GPU server: ``Req``, ``LogitsProcessorOutput`` (SimpleNamespace with the
  same attribute names), the TP rank (``get_parallel``).
- The unified diff, applied with ``patch`` to copies of the pristine installed files.
"""

from __future__ import annotations

import ast
import enum
import functools
import shutil
import subprocess
import sys
from types import ModuleType, SimpleNamespace

import pytest
import torch
from conftest import ROOT

PATCHES = ROOT / "patches"
sys.path.insert(0, str(PATCHES))
import eagle3_capture as ec  # noqa: E402
import sglang_capture_launcher as launcher  # noqa: E402
import sglang_source as src  # noqa: E402

SGL = src.sglang_root()
needs_sglang = pytest.mark.skipif(
    SGL is None, reason="SGLang not installed (CI: pip install --no-deps sglang==0.5.23)"
)
DIFF = PATCHES / "sglang-0.5.23-capture.diff"
BRP = "srt/managers/scheduler_components/batch_result_processor.py"
UTILS = "srt/managers/utils.py"
ABS = "srt/model_executor/model_runner_components/attention_backend_setup.py"


def _file(mod: str):
    """Installed file of an ``sglang.*`` module name."""
    return SGL / (mod.split(".", 1)[1].replace(".", "/") + ".py")


# ---- version and source the patch was written against ----------------------------------------
@needs_sglang
def test_installed_version_is_the_patched_one():
    assert src.installed_version() == launcher.REQUIRED_VERSION == "0.5.23"
    assert (SGL / "_version.py").read_text().count("0.5.23") >= 1


def test_version_check_refuses_others():
    launcher.check_version("0.5.23")
    with pytest.raises(launcher.LaunchError, match="for sglang==0.5.23, found 0.5.22"):
        launcher.check_version("0.5.22")
    with pytest.raises(launcher.LaunchError, match="not installed"):
        launcher.check_version(None)


@needs_sglang
def test_patch_targets_exist_with_expected_signatures():
    sig = {t: src.arg_names(_file(m), t.split(":")[0]) for m, t in launcher.PATCH_TARGETS[:3]}
    assert sig["SchedulerBatchResultProcessor._append_prefill_hidden_states"] == {
        "args": ["self"],
        "kwonly": [
            "req",
            "logits_output",
            "hidden_state_offset",
            "capture_hidden_mode",
            "extend_input_len",
            "store",
        ],
    }
    assert sig["GenerationBatchResult.copy_to_cpu"] == {
        "args": ["self", "return_logprob", "return_hidden_states"],
        "kwonly": [],
    }
    assert sig["configure_aux_hidden_state_capture"] == {
        "args": [],
        "kwonly": [
            "model",
            "eagle_use_aux_hidden_state",
            "eagle_aux_hidden_state_layer_ids",
            "dflash_use_aux_hidden_state",
            "dflash_target_layer_ids",
            "is_dspark",
        ],
    }
    # model_runner.py binds the name at import (so the launcher must patch it there too) and calls it by keyword
    tree = ast.parse(_file(launcher.PATCH_TARGETS[3][0]).read_text())
    imports = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.ImportFrom)
        and n.module == launcher.PATCH_TARGETS[2][0]
        and any(a.name == "configure_aux_hidden_state_capture" for a in n.names)
    ]
    assert len(imports) == 1
    calls = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
        and getattr(n.func, "id", None) == "configure_aux_hidden_state_capture"
    ]
    assert calls and all(not c.args for c in calls)


@needs_sglang
def test_source_facts_the_patch_relies_on():
    """Facts from SGLang 0.5.23 the writer depends on (each would silently corrupt data if it changed)."""
    lp = (SGL / "srt/layers/logits_processor.py").read_text()
    # the post-norm last hidden state is kept only for full capture with aux states, "not copied into the response"
    assert (
        "last_hidden_states: Optional[torch.Tensor] = None" in lp
        and "not copied into the response path" in lp
    )
    body = src.def_source(
        SGL / "srt/layers/logits_processor.py", "LogitsProcessor._get_last_hidden_states_to_store"
    )
    assert (
        "logits_metadata.capture_hidden_mode.is_full()" in body and "return hidden_states" in body
    )
    # copy_done.record() is the LAST statement of copy_to_cpu: the patch's extra copy goes before it
    fn = src.find_def(SGL / UTILS, "GenerationBatchResult.copy_to_cpu")
    last = fn.body[-1]
    assert ast.unparse(last) == "self.copy_done.record()"
    # SGLang spawns its workers (the launcher relies on the __mp_main__ re-import)
    assert 'mp.set_start_method("spawn", force=True)' in src.def_source(
        SGL / "srt/entrypoints/engine.py", "_set_envs_and_config"
    )
    # the launcher re-creates launch_server.py's __main__ block with these names
    ls = (SGL / "launch_server.py").read_text()
    for name in (
        "load_plugins()",
        "prepare_server_args(sys.argv[1:])",
        "run_server(server_args)",
        "kill_process_tree(os.getpid(), include_parent=False)",
    ):
        assert name in ls
    assert "def run_server(server_args)" in ls


# ---- the writer with SGLang's real functions -------------------------------------------------
@pytest.fixture()
def sgl_real():
    """SGLang's original functions/classes, compiled from the installed 0.5.23 source."""
    if SGL is None:
        pytest.skip("SGLang not installed")
    fbi = SGL / "srt/model_executor/forward_batch_info.py"
    return SimpleNamespace(
        CaptureHiddenMode=src.compile_class(
            fbi,
            "CaptureHiddenMode",
            {"IntEnum": enum.IntEnum, "total_ordering": functools.total_ordering},
        ),
        append=src.compile_def(
            SGL / BRP, "SchedulerBatchResultProcessor._append_prefill_hidden_states"
        ),
        aux=src.load_file_module(SGL / "srt/layers/aux_hidden_states.py", "sgl_aux_hidden_states"),
        configure=src.compile_def(SGL / ABS, "configure_aux_hidden_state_capture"),
        ds_set_layers=src.compile_def(
            SGL / "srt/models/deepseek_v2.py", "DeepseekV2ForCausalLM.set_eagle3_layers_to_capture"
        ),
    )


def _batch(sgl_real, lens, H=8, K=3, packed=True):
    """A prefill batch as SGLang's logits processor leaves it: aux rows [T, K*H] and last [T, H]."""
    T = sum(lens)
    g = torch.Generator().manual_seed(1)
    layers = [torch.randn(T, H, generator=g).to(torch.bfloat16) for _ in range(K)]  # K x [T, H]
    if packed:  # DeepSeek path: AuxHiddenStatePacker
        pk = sgl_real.aux.AuxHiddenStatePacker(K)
        for t in layers:
            pk.capture(t)
        aux = pk.finalize()  # [T, K*H]
    else:  # Llama path: AuxHiddenStateList, then pack_aux_hidden_states (torch.cat)
        lst = sgl_real.aux.AuxHiddenStateList()
        for t in layers:
            lst.capture(t)
        aux = sgl_real.aux.pack_aux_hidden_states(lst)  # [T, K*H]
    last = torch.randn(T, H, generator=g).to(torch.bfloat16)  # [T, H]
    lo = SimpleNamespace(hidden_states=aux, last_hidden_states=last)
    reqs = [
        SimpleNamespace(
            rid=f"req{i}",
            origin_input_ids=list(range(100 + i, 100 + i + n)),
            return_hidden_states=True,
            hidden_states=[],
        )
        for i, n in enumerate(lens)
    ]
    return layers, last, lo, reqs


@pytest.mark.parametrize("packed", [True, False])
def test_patched_append_writes_files(sgl_real, tmp_path, monkeypatch, packed):
    monkeypatch.setenv(ec.ENV_DIR, str(tmp_path))
    monkeypatch.setitem(ec._STATE, "layers", [3, 31, 59])
    lens = [5, 3, 4]
    layers, last, lo, reqs = _batch(sgl_real, lens, packed=packed)
    patched = launcher.make_append_prefill_hidden_states(sgl_real.append)
    full = sgl_real.CaptureHiddenMode.FULL
    off = 0
    for req, n in zip(reqs, lens):  # as process_batch_result_prefill walks the batch
        new = patched(
            None,
            req=req,
            logits_output=lo,
            hidden_state_offset=off,
            capture_hidden_mode=full,
            extend_input_len=n,
            store=True,
        )
        assert new == off + n
        obj = torch.load(tmp_path / f"{req.rid}.pt", weights_only=True)
        assert (
            obj["rid"] == req.rid
            and obj["layers"] == [3, 31, 59]
            and obj["last_hidden_state"] == "post_norm"
        )
        assert torch.equal(obj["input_ids"], torch.tensor(req.origin_input_ids))
        assert len(obj["hidden_states"]) == 4
        for k in range(3):
            assert torch.equal(obj["hidden_states"][k], layers[k][off : off + n])
        assert torch.equal(obj["hidden_states"][3], last[off : off + n])
        # compact storage: the file holds n rows, not the whole batch buffer
        assert all(t.untyped_storage().nbytes() == n * 8 * 2 for t in obj["hidden_states"])
        assert req.hidden_states == []  # the JSON response carries no float lists
        off = new
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "req0.pt",
        "req1.pt",
        "req2.pt",
    ]  # no temp files left


def test_unpatched_paths_are_sglang_original(sgl_real, tmp_path, monkeypatch):
    lens = [2, 3]
    _, _, lo, reqs = _batch(sgl_real, lens)
    patched = launcher.make_append_prefill_hidden_states(sgl_real.append)
    full, last_mode = sgl_real.CaptureHiddenMode.FULL, sgl_real.CaptureHiddenMode.LAST
    # capture disabled (no EAGLE3_CAPTURE_DIR): identical to SGLang's float lists
    monkeypatch.delenv(ec.ENV_DIR, raising=False)
    ref = [SimpleNamespace(**vars(r)) for r in reqs]
    for r in ref:
        r.hidden_states = []
    assert (
        patched(
            None,
            req=reqs[0],
            logits_output=lo,
            hidden_state_offset=0,
            capture_hidden_mode=full,
            extend_input_len=2,
        )
        == sgl_real.append(
            None,
            req=ref[0],
            logits_output=lo,
            hidden_state_offset=0,
            capture_hidden_mode=full,
            extend_input_len=2,
        )
        == 2
    )
    assert reqs[0].hidden_states == ref[0].hidden_states and len(reqs[0].hidden_states[0]) == 2
    assert (
        len(reqs[0].hidden_states[0][0]) == 24
    )  # [L, 3H] floats: what the patch removes from the JSON
    # LAST mode and return_hidden_states="last" go to the original even with the capture on
    monkeypatch.setenv(ec.ENV_DIR, str(tmp_path))
    lo_last = SimpleNamespace(hidden_states=lo.hidden_states[:2], last_hidden_states=None)
    assert (
        patched(
            None,
            req=reqs[1],
            logits_output=lo_last,
            hidden_state_offset=1,
            capture_hidden_mode=last_mode,
            extend_input_len=3,
        )
        == 2
    )
    assert reqs[1].hidden_states == [lo.hidden_states[1].tolist()]
    reqs[1].return_hidden_states = "last"
    reqs[1].hidden_states = []
    assert (
        patched(
            None,
            req=reqs[1],
            logits_output=lo,
            hidden_state_offset=2,
            capture_hidden_mode=full,
            extend_input_len=3,
        )
        == 5
    )
    assert reqs[1].hidden_states == [lo.hidden_states[4].tolist()]
    assert list(tmp_path.iterdir()) == []


def test_incomplete_prefill_and_store_false(sgl_real, tmp_path, monkeypatch):
    monkeypatch.setenv(ec.ENV_DIR, str(tmp_path))
    _, _, lo, reqs = _batch(sgl_real, [4, 4])
    patched = launcher.make_append_prefill_hidden_states(sgl_real.append)
    full = sgl_real.CaptureHiddenMode.FULL
    # radix-cache hit: only 3 of the 4 prompt tokens were prefilled
    assert (
        patched(
            None,
            req=reqs[0],
            logits_output=lo,
            hidden_state_offset=0,
            capture_hidden_mode=full,
            extend_input_len=3,
        )
        == 3
    )
    import json

    msg = json.loads((tmp_path / "req0.error.json").read_text())["error"]
    assert "covered 3 of 4 prompt tokens" in msg and "--disable-radix-cache" in msg
    assert not (tmp_path / "req0.pt").exists()
    # store=False (finished/retracted request): offset advances, nothing written
    assert (
        patched(
            None,
            req=reqs[1],
            logits_output=lo,
            hidden_state_offset=4,
            capture_hidden_mode=full,
            extend_input_len=4,
            store=False,
        )
        == 8
    )
    assert not (tmp_path / "req1.pt").exists()
    # missing last_hidden_states (server without --enable-return-aux-hidden-states)
    lo.last_hidden_states = None
    patched(
        None,
        req=reqs[1],
        logits_output=lo,
        hidden_state_offset=4,
        capture_hidden_mode=full,
        extend_input_len=4,
    )
    assert (
        "--enable-return-aux-hidden-states"
        in json.loads((tmp_path / "req1.error.json").read_text())["error"]
    )


def test_writer_rank(monkeypatch, tmp_path, sgl_real):
    """Only attention-TP rank 0 writes (stand-in for SGLang's runtime_context.get_parallel)."""
    fake = ModuleType("sglang.srt.runtime_context")
    par = SimpleNamespace(tp_rank=1, attn_tp_rank=1, attn_cp_rank=0)
    fake.get_parallel = lambda: par
    monkeypatch.setitem(sys.modules, "sglang.srt.runtime_context", fake)
    assert ec.is_writer_rank() is False
    monkeypatch.setenv(ec.ENV_DIR, str(tmp_path))
    _, _, lo, reqs = _batch(sgl_real, [2])
    assert (
        ec.store_prefill_capture(
            req=reqs[0], logits_output=lo, start=0, extend_input_len=2, store=True
        )
        == 2
    )
    assert list(tmp_path.iterdir()) == []
    par.attn_tp_rank = 0
    assert ec.is_writer_rank() is True
    ec.store_prefill_capture(req=reqs[0], logits_output=lo, start=0, extend_input_len=2, store=True)
    assert (tmp_path / "req0.pt").is_file()


def test_copy_to_cpu_queues_last_before_copy_done(sgl_real, monkeypatch, tmp_path):
    """Run SGLang's real copy_to_cpu through the wrapper; the last-state copy precedes copy_done.record()."""
    monkeypatch.setenv(ec.ENV_DIR, str(tmp_path))
    events = []

    def d2h(t):
        events.append(("d2h", tuple(t.shape)))
        return t.clone()

    original = src.compile_def(
        SGL / UTILS, "GenerationBatchResult.copy_to_cpu", {"_async_d2h": d2h, "torch": torch}
    )
    wrapped = launcher.make_copy_to_cpu(original, d2h)
    lo = SimpleNamespace(
        next_token_logprobs=None,
        input_token_logprobs=None,
        next_token_top_logprobs_val=None,
        next_token_top_logprobs_idx=None,
        next_token_token_ids_logprobs_val=None,
        hidden_states=torch.zeros(5, 24),
        last_hidden_states=torch.ones(5, 8),
        sampling_mask_output=None,
        auxiliary_device_output=None,
    )
    res = SimpleNamespace(
        logits_output=lo,
        next_token_ids=torch.zeros(2),
        accept_lens=None,
        block_accept_lens=None,
        cap_lens=None,
        routed_experts_output=None,
        indexer_topk_output=None,
        expert_distribution_metrics=None,
        auxiliary_host_output=None,
        copy_done=SimpleNamespace(record=lambda: events.append(("record",))),
    )
    res.copy_auxiliary_output_to_cpu = lambda: None
    wrapped(res, False, True)
    assert events == [("d2h", (5, 8)), ("d2h", (5, 24)), ("d2h", (2,)), ("record",)]
    events.clear()
    lo.last_hidden_states = torch.ones(5, 8)
    wrapped(res, False, False)  # request without hidden states: untouched
    assert events == [("d2h", (2,)), ("record",)]


def test_configure_records_layers(sgl_real, tmp_path, monkeypatch):
    """SGLang's configure_aux_hidden_state_capture + DeepSeek's set_eagle3_layers_to_capture, wrapped."""
    monkeypatch.setenv(ec.ENV_DIR, str(tmp_path))
    inner = SimpleNamespace(
        pp_group=SimpleNamespace(is_last_rank=True),
        config=SimpleNamespace(num_hidden_layers=61, hidden_size=7168, vocab_size=163840),
        model=SimpleNamespace(layers_to_capture=[]),
        capture_aux_hidden_states=False,
    )
    inner.set_eagle3_layers_to_capture = lambda ids=None: sgl_real.ds_set_layers(inner, ids)
    wrapped = launcher.make_configure_aux(sgl_real.configure)
    wrapped(
        model=inner,
        eagle_use_aux_hidden_state=True,
        eagle_aux_hidden_state_layer_ids=[3, 31, 59],
        dflash_use_aux_hidden_state=False,
        dflash_target_layer_ids=None,
        is_dspark=False,
    )
    import json

    info = json.loads((tmp_path / ec.INFO_FILE).read_text())
    assert info["layers_to_capture"] == [3, 31, 59] and ec._STATE["layers"] == [3, 31, 59]
    assert (info["num_hidden_layers"], info["hidden_size"], info["vocab_size"]) == (
        61,
        7168,
        163840,
    )
    assert info["last_hidden_state"] == "post_norm" and info["sglang_version"] == "0.5.23"
    # Kimi-K2.5 wrapper: layers live on language_model.model
    k25 = SimpleNamespace(language_model=inner, config=SimpleNamespace(text_config=inner.config))
    assert ec.layers_to_capture_of(k25) == [3, 31, 59]


# ---- launcher argv handling ------------------------------------------------------------------
GOOD = [
    "--model-path",
    "/models/Kimi-K2.5",
    "--trust-remote-code",
    "--tp-size",
    "8",
    "--enable-return-aux-hidden-states",
    "--speculative-algorithm",
    "EAGLE3",
    "--return-aux-hidden-state-layer-ids",
    "3",
    "31",
    "59",
    "--disable-radix-cache",
    "--chunked-prefill-size",
    "-1",
    "--disable-overlap-schedule",
]


def test_split_and_check_flags():
    cap, ml, rest = launcher.split_args(["--capture-dir", "/x", *GOOD, "--max-length=4096"])
    assert cap == "/x" and ml == 4096 and rest == GOOD
    launcher.check_server_flags(rest, ml)
    with pytest.raises(launcher.LaunchError, match="--capture-dir DIR is required"):
        launcher.split_args(GOOD)
    with pytest.raises(launcher.LaunchError, match="missing server flag --disable-radix-cache"):
        launcher.check_server_flags([a for a in GOOD if a != "--disable-radix-cache"])
    launcher.check_server_flags(GOOD, 16384)
    with pytest.raises(launcher.LaunchError, match="--enable-dp-attention"):
        launcher.check_server_flags([*GOOD, "--enable-dp-attention"])
    with pytest.raises(launcher.LaunchError, match="--speculative-algorithm EAGLE3"):
        launcher.check_server_flags([a if a != "EAGLE3" else "DFLASH" for a in GOOD])


def test_chunked_prefill_must_be_off_even_above_max_length():
    """A positive --chunked-prefill-size is refused even when >= max_length: SGLang's chunk budget is per prefill
    batch, so a short prompt that overflows what the batch's other prompts left is split (fresh-user trial 05e)."""
    chunked = [*GOOD[:-3], "--chunked-prefill-size", "8192", "--disable-overlap-schedule"]
    with pytest.raises(
        launcher.LaunchError, match=r"--chunked-prefill-size 8192: use -1 \(chunked prefill off\)"
    ):
        launcher.check_server_flags(chunked, 4096)
    with pytest.raises(launcher.LaunchError, match="--chunked-prefill-size 8192: use -1"):
        launcher.check_server_flags(chunked)
    with pytest.raises(launcher.LaunchError, match="--chunked-prefill-size 65536: use -1"):
        launcher.check_server_flags([*GOOD[:-3], "--chunked-prefill-size=65536"], 4096)
    launcher.check_server_flags(GOOD, 4096)  # -1 passes


@needs_sglang
def test_sglang_splits_a_short_prompt_that_overflows_the_batch_chunk_budget():
    """The SGLang 0.5.23 fact behind requiring -1: ``_select_prefill_admission`` compares each request with what is
    LEFT of the batch's chunk budget (``chunk_limit = self.rem_chunk_tokens``) and marks it chunked when it does
    not fit, and ``_update_prefill_budget`` debits every admitted request from that one budget."""
    body = src.def_source(
        SGL / "srt/managers/schedule_policy.py", "PrefillAdder._select_prefill_admission"
    )
    assert "chunk_limit = self.rem_chunk_tokens" in body
    assert "chunk_fit_tokens > chunk_tokens_limit" in body and "is_chunked = True" in body
    upd = src.def_source(
        SGL / "srt/managers/schedule_policy.py", "PrefillAdder._update_prefill_budget"
    )
    assert "self.rem_chunk_tokens -= compute_charge" in upd


def _documented_launches() -> list[tuple[str, list[str]]]:
    """Every ``sglang_capture_launcher.py`` command written in the docs and the launcher's docstring, as argv."""
    import shlex

    out = []
    for path in (
        PATCHES / "README.md",
        ROOT / "docs" / "sglang.md",
        PATCHES / "sglang_capture_launcher.py",
    ):
        text = path.read_text().replace("\\\\\n", " ").replace("\\\n", " ")
        for line in text.splitlines():
            line = " ".join(line.split())
            if "sglang_capture_launcher.py --capture-dir" in line:
                argv = shlex.split(line.split("#")[0])
                out.append(
                    (
                        path.name,
                        argv[
                            argv.index(
                                next(a for a in argv if a.endswith("sglang_capture_launcher.py"))
                            )
                            + 1 :
                        ],
                    )
                )
    return out


def test_documented_launch_commands_pass_the_launcher_checks():
    """The launch commands users copy (patches/README.md, docs/sglang.md, the launcher's usage) pass its own checks:
    they said --chunked-prefill-size 8192, which SGLang splits requests under (trial 05e)."""
    launches = _documented_launches()
    assert {name for name, _ in launches} == {
        "README.md",
        "sglang.md",
        "sglang_capture_launcher.py",
    }
    for name, argv in launches:
        cap, ml, rest = launcher.split_args(argv)
        assert cap == "/dev/shm/eagle3-capture", name
        launcher.check_server_flags(rest, ml)
        assert launcher._flag_value(rest, "--chunked-prefill-size") == "-1", name


def test_launcher_cli_rejects_bad_flags_before_importing_sglang(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            str(PATCHES / "sglang_capture_launcher.py"),
            "--capture-dir",
            str(tmp_path),
            *[a for a in GOOD if a != "--enable-return-aux-hidden-states"],
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "missing server flag --enable-return-aux-hidden-states" in r.stderr


def test_importing_launcher_does_not_patch():
    assert launcher.__name__ == "sglang_capture_launcher"
    assert "sglang.srt.managers.scheduler_components.batch_result_processor" not in sys.modules


# ---- the unified diff ----------------------------------------------------------------------
def _diff_files() -> list[str]:
    return [ln.split()[1][2:] for ln in DIFF.read_text().splitlines() if ln.startswith("+++ ")]


def _apply_diff(dest):
    """Copy the pristine installed files the diff touches into ``dest`` and apply the diff there (``patch -p1``)."""
    for f in _diff_files()[1:]:
        (dest / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(SGL.parent / f, dest / f)
    return subprocess.run(
        ["patch", "-p1", "-d", str(dest), "-i", str(DIFF)], capture_output=True, text=True
    )


@needs_sglang
@pytest.mark.skipif(shutil.which("patch") is None, reason="GNU patch not installed")
def test_diff_applies_to_pristine_0_5_23(tmp_path):
    files = _diff_files()
    assert files == [
        "sglang/srt/managers/eagle3_capture.py",
        "sglang/" + BRP,
        "sglang/" + UTILS,
        "sglang/" + ABS,
    ]
    # dry run against the installed tree itself, then a real apply to copies of the pristine files
    r = subprocess.run(
        ["patch", "-p1", "--dry-run", "-d", str(SGL.parent), "-i", str(DIFF)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    r = _apply_diff(tmp_path)
    assert r.returncode == 0 and "FAILED" not in r.stdout and "offset" not in r.stdout, r.stdout
    # the added module is exactly patches/eagle3_capture.py (the launcher and the diff cannot drift apart)
    assert (tmp_path / files[0]).read_text() == (PATCHES / "eagle3_capture.py").read_text()
    brp = (tmp_path / files[1]).read_text()
    ast.parse(brp)
    body = src.def_source(
        tmp_path / files[1], "SchedulerBatchResultProcessor._append_prefill_hidden_states"
    )
    assert (
        "eagle3_capture.store_prefill_capture(" in body
        and "req.return_hidden_states is True" in body
    )
    assert (
        "eagle3_capture.copy_last_hidden_states(self, return_hidden_states, _async_d2h)"
        in src.def_source(tmp_path / files[2], "GenerationBatchResult.copy_to_cpu")
    )
    assert "eagle3_capture.record_capture_layers(model)" in src.def_source(
        tmp_path / files[3], "configure_aux_hidden_state_capture"
    )
    # the patched copy_to_cpu still ends with copy_done.record()
    assert (
        ast.unparse(src.find_def(tmp_path / files[2], "GenerationBatchResult.copy_to_cpu").body[-1])
        == "self.copy_done.record()"
    )


@needs_sglang
def test_diffed_append_behaves_like_the_launcher(sgl_real, tmp_path, monkeypatch):
    """Compile the diff's patched _append_prefill_hidden_states and run it: same files as the monkeypatch."""
    if shutil.which("patch") is None:
        pytest.skip("GNU patch not installed")
    f = "sglang/" + BRP
    r = _apply_diff(tmp_path / "t")
    assert r.returncode == 0, r.stdout
    fn = src.compile_def(
        tmp_path / "t" / f,
        "SchedulerBatchResultProcessor._append_prefill_hidden_states",
        {"eagle3_capture": ec},
    )
    out = tmp_path / "cap"
    monkeypatch.setenv(ec.ENV_DIR, str(out))
    layers, last, lo, reqs = _batch(sgl_real, [3, 2])
    assert (
        fn(
            None,
            req=reqs[1],
            logits_output=lo,
            hidden_state_offset=3,
            capture_hidden_mode=sgl_real.CaptureHiddenMode.FULL,
            extend_input_len=2,
            store=True,
        )
        == 5
    )
    obj = torch.load(out / "req1.pt", weights_only=True)
    assert torch.equal(obj["hidden_states"][1], layers[1][3:5]) and torch.equal(
        obj["hidden_states"][3], last[3:5]
    )


@needs_sglang
def test_apply_patch_wires_all_targets(sgl_real, monkeypatch, tmp_path):
    """apply_patch() on stand-in modules holding SGLang's real functions: every target replaced, both
    names of configure_aux_hidden_state_capture, idempotent, and the version gate uses sglang.__version__."""
    utils_copy = src.compile_def(
        SGL / UTILS, "GenerationBatchResult.copy_to_cpu", {"_async_d2h": lambda t: t}
    )
    BRPcls = type(
        "SchedulerBatchResultProcessor", (), {"_append_prefill_hidden_states": sgl_real.append}
    )
    GBR = type("GenerationBatchResult", (), {"copy_to_cpu": utils_copy})
    mods = {
        "sglang": SimpleNamespace(__version__="0.5.23"),
        launcher.PATCH_TARGETS[0][0]: SimpleNamespace(SchedulerBatchResultProcessor=BRPcls),
        launcher.PATCH_TARGETS[1][0]: SimpleNamespace(
            GenerationBatchResult=GBR, _async_d2h=lambda t: t
        ),
        launcher.PATCH_TARGETS[2][0]: SimpleNamespace(
            configure_aux_hidden_state_capture=sgl_real.configure
        ),
        launcher.PATCH_TARGETS[3][0]: SimpleNamespace(
            configure_aux_hidden_state_capture=sgl_real.configure
        ),
    }
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    launcher.apply_patch()
    launcher.apply_patch()  # idempotent: no double wrapping
    assert BRPcls._append_prefill_hidden_states.__eagle3_patched__
    assert BRPcls._append_prefill_hidden_states.__wrapped__ is sgl_real.append
    assert GBR.copy_to_cpu.__wrapped__ is utils_copy
    cfg_a = mods[launcher.PATCH_TARGETS[2][0]].configure_aux_hidden_state_capture
    assert cfg_a is mods[launcher.PATCH_TARGETS[3][0]].configure_aux_hidden_state_capture
    assert cfg_a.__wrapped__ is sgl_real.configure
    mods["sglang"].__version__ = "0.5.22"
    with pytest.raises(launcher.LaunchError, match="found 0.5.22"):
        launcher.apply_patch()


@needs_sglang
@pytest.mark.parametrize(
    "file, cls, arch",
    [
        (
            "glm4_moe_lite.py",
            "Glm4MoeLiteForCausalLM",
            "Glm4MoeLiteForCausalLM",
        ),  # own copy of the DeepSeek rule
        (
            "deepseek_v2.py",
            "DeepseekV2ForCausalLM",
            "MistralLarge3ForCausalLM",
        ),  # subclass of DeepseekV3ForCausalLM
        (
            "deepseek_v2.py",
            "DeepseekV2ForCausalLM",
            "GlmMoeDsaForCausalLM",
        ),  # subclass of DeepseekV2ForCausalLM
    ],
)
def test_layers_rule_for_other_deepseek_style_classes(file, cls, arch):
    from eagle3.engines.layers import engine_layer_ids

    fn = src.compile_def(SGL / "srt/models" / file, f"{cls}.set_eagle3_layers_to_capture")
    m = SimpleNamespace(
        pp_group=SimpleNamespace(is_last_rank=True),
        config=SimpleNamespace(num_hidden_layers=47),
        model=SimpleNamespace(layers_to_capture=[]),
        capture_aux_hidden_states=False,
    )
    hf = [3, 24, 44]
    fn(m, engine_layer_ids(hf, "sglang", arch))
    assert m.model.layers_to_capture == hf
