"""Export contract (issue 11 items 5, 6): drafter/verifier shapes checked at export, embeddings
written or refused explicitly; each folder records which engine it is for, and loaders refuse or
warn when a folder is used by the other engine or its layer ids disagree with the shards."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from test_export import DSV3_61, LLAMA30, drafter  # noqa: E402

from eagle3.drafter.args import DrafterArgs
from eagle3.drafter.model import Eagle3Drafter  # noqa: E402  # noqa: E402
from eagle3.errors import UserError  # noqa: E402
from eagle3.export.common import CONFIG_BLOCK, META_FILE
from eagle3.export.reader import check_export_folder, load_exported
from eagle3.export.writer import export_drafter


def _wide_drafter() -> Eagle3Drafter:
    """Drafter with hidden 32 reading a verifier of hidden 24 (the shape SGLang handles by keeping its own embedding)."""
    torch.manual_seed(0)
    a = DrafterArgs(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=40,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=64,
        draft_vocab_size=50,
        target_vocab_size=50,
        target_hidden_size=24,
    )
    d = Eagle3Drafter(a)
    with torch.no_grad():
        d.embed_tokens.weight.normal_()
    return d


# ---- item 5: shape contract ---------------------------------------------------------------------
def test_hidden_size_differs_from_verifier_needs_embeddings(tmp_path):
    d = _wide_drafter()
    with pytest.raises(
        UserError,
        match=r"hidden_size 32 differs from the verifier hidden_size 24.*include_embeddings=True",
    ):
        export_drafter(d, tmp_path / "x", "sglang", [2, 15, 27], LLAMA30)
    assert not (tmp_path / "x").exists()
    out = export_drafter(
        d, tmp_path / "x", "sglang", [2, 15, 27], LLAMA30, include_embeddings=True, dtype="float32"
    )
    assert list(load_file(str(out / "model.safetensors"))["embed_tokens.weight"].shape) == [50, 32]
    re = load_exported(out)  # no verifier embedding needed: the folder carries the drafter's own
    assert torch.equal(re.embed_tokens.weight, d.embed_tokens.weight)
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["target_hidden_size"]) == (32, 24)


def test_loading_wide_drafter_without_embeddings_explains(tmp_path):
    d = _wide_drafter()
    out = export_drafter(d, tmp_path / "x", "sglang", [2, 15, 27], LLAMA30, include_embeddings=True)
    sd = load_file(str(out / "model.safetensors"))
    del sd["embed_tokens.weight"]
    from safetensors.torch import save_file

    save_file(sd, str(out / "model.safetensors"))
    with pytest.raises(UserError, match="must carry its own 'embed_tokens.weight'"):
        load_exported(out, embed_weight=torch.zeros(50, 24))


@pytest.mark.parametrize(
    "module,layer,msg",
    [
        (
            "fc",
            nn.Linear(48, 24, bias=False),
            r"'fc.weight': shape \[24, 48\].*\[hidden_size, 3 x verifier hidden_size\] = \[24, 3 x 24\]",
        ),
        (
            "lm_head",
            nn.Linear(24, 17, bias=False),
            r"'lm_head.weight': shape \[17, 24\].*\[16, 24\]",
        ),
    ],
)
def test_tensor_shapes_checked_against_contract(tmp_path, module, layer, msg):
    d = drafter()
    setattr(d, module, layer)
    with pytest.raises(UserError, match=msg):
        export_drafter(d, tmp_path / "x", "sglang", [2, 15, 27], LLAMA30)
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_a_tensor_the_folder_stores_missing_from_the_state_is_one_line_nothing_written(
    tmp_path, engine
):
    """:func:`eagle3.export.common.check_export_contract` owns the drafter state's tensors: shapes and presence."""
    d = drafter()
    d.midlayer.hidden_norm = nn.Identity()  # its weight gone from the state
    with pytest.raises(UserError) as e:
        export_drafter(d, tmp_path / "x", engine, [2, 15, 27], LLAMA30)
    assert str(e.value) == (
        "drafter state: missing required tensor 'midlayer.hidden_norm.weight' "
        f"(export key '{'layers.0' if engine == 'vllm' else 'midlayer'}.hidden_norm.weight')"
    )
    assert not (tmp_path / "x").exists()


def test_invalid_vocab_buffers_refused_at_export(tmp_path):
    d = drafter()
    with torch.no_grad():
        d.d2t[1] = (
            d.d2t[0] - 1
        )  # draft id 1 -> the target id of draft id 0 (buffer written directly)
    with pytest.raises(
        UserError, match=r"drafter vocab map: key 'd2t': draft ids 0 and 1 both map"
    ):
        export_drafter(d, tmp_path / "x", "vllm", [2, 15, 27], LLAMA30)


def test_verifier_vocab_differs(tmp_path):
    with pytest.raises(UserError, match=r"verifier_info.vocab_size: 51"):
        export_drafter(
            drafter(), tmp_path / "x", "sglang", [2, 15, 27], {**LLAMA30, "vocab_size": 51}
        )


# ---- item 6: which folder for which engine -------------------------------------------------------
@pytest.mark.parametrize(
    "engine,info,ids,conv",
    [
        ("sglang", LLAMA30, [1, 14, 26], "sglang-llama"),
        ("sglang", DSV3_61, [2, 30, 58], "sglang-deepseek"),
        ("vllm", LLAMA30, [2, 15, 27], "hf"),
    ],
)
def test_config_json_records_engine_and_convention(tmp_path, engine, info, ids, conv):
    aux = [2, 15, 27] if info is LLAMA30 else [2, 30, 58]
    out = export_drafter(drafter(), tmp_path / "x", engine, aux, info)
    block = json.loads((out / "config.json").read_text())[CONFIG_BLOCK]
    assert (
        block["engine"] == engine
        and block["aux_layers_hf"] == aux
        and block["engine_layer_ids"] == ids
    )
    assert block["layer_id_convention"].startswith(conv + ":")
    assert block["verifier_architecture"] == info["architecture"]
    got = check_export_folder(out)
    assert (got["engine"], got["engine_layer_ids"], got["aux_layers_hf"], got["warnings"]) == (
        engine,
        ids,
        aux,
        [],
    )


def test_sglang_folder_for_vllm_is_refused_and_vice_versa(tmp_path):
    sg = export_drafter(drafter(), tmp_path / "sg", "sglang", [2, 15, 27], LLAMA30)
    vl = export_drafter(drafter(), tmp_path / "vl", "vllm", [2, 15, 27], LLAMA30)
    with pytest.raises(
        UserError, match=r"this folder is for sglang, but vllm serves it.*--engine vllm"
    ):
        check_export_folder(sg, serving_engine="vllm")
    with pytest.raises(
        UserError, match=r"this folder is for vllm, but sglang serves it.*--engine sglang"
    ):
        check_export_folder(vl, serving_engine="sglang")
    assert check_export_folder(sg, serving_engine="sglang")["warnings"] == []


def test_hf_ids_written_into_sglang_folder_are_refused(tmp_path):
    """The off-by-one: someone puts the HF indices into the SGLang folder's eagle_config."""
    d = drafter()
    out = export_drafter(d, tmp_path / "x", "sglang", [2, 15, 27], LLAMA30)
    cfg = json.loads((out / "config.json").read_text())
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [2, 15, 27]
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        UserError,
        match=r"layer ids \[2, 15, 27\] are not sglang's ids for the recorded HF aux layers "
        r"\[2, 15, 27\] \(expected \[1, 14, 26\]",
    ):
        load_exported(out, embed_weight=d.embed_tokens.weight)


def test_folder_mixing_two_exports_is_refused(tmp_path):
    """vLLM config.json copied over an SGLang folder's metadata (or the other way round)."""
    d = drafter()
    sg = export_drafter(d, tmp_path / "sg", "sglang", [2, 15, 27], LLAMA30)
    vl = export_drafter(d, tmp_path / "vl", "vllm", [2, 15, 27], LLAMA30)
    cfg = json.loads((vl / "config.json").read_text())
    cfg[CONFIG_BLOCK] = json.loads((sg / "config.json").read_text())[CONFIG_BLOCK]
    (vl / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        UserError, match=r"key 'engine' is 'sglang' but .*config.json is in the vllm format"
    ):
        load_exported(vl, embed_weight=d.embed_tokens.weight)


def test_third_party_folder_layers_from_engine_rule(tmp_path):
    """No eagle3_train block or metadata: the ids are converted with the engine's rule and compared with the shards."""
    out = export_drafter(drafter(), tmp_path / "x", "sglang", [2, 15, 27], LLAMA30)
    cfg = json.loads((out / "config.json").read_text())
    del cfg[CONFIG_BLOCK]
    (out / "config.json").write_text(json.dumps(cfg))
    (out / META_FILE).unlink()
    got = check_export_folder(
        out, shards_aux_hf=[2, 15, 27], verifier_architecture="LlamaForCausalLM"
    )
    assert got["aux_layers_hf"] == [2, 15, 27] and got["warnings"] == []
    got = check_export_folder(
        out, shards_aux_hf=[1, 14, 26], verifier_architecture="LlamaForCausalLM"
    )
    assert (
        len(got["warnings"]) == 1
        and "sglang will capture HF layers [2, 15, 27]" in got["warnings"][0]
    )
    assert "cannot tell" in check_export_folder(out)["warnings"][0]


def test_benchmark_warns_when_folder_layers_differ(tmp_path):
    from eagle3.decoding.checks import export_folder_warnings

    out = export_drafter(drafter(), tmp_path / "x", "sglang", [2, 15, 27], LLAMA30)
    assert export_folder_warnings(out, [2, 15, 27], "LlamaForCausalLM") == []
    w = export_folder_warnings(out, [3, 15, 27], "LlamaForCausalLM")
    assert len(w) == 1 and "sglang would capture HF layers [2, 15, 27]" in w[0]


def test_the_other_engines_folder_refusal_gives_a_way_that_works_here(tmp_path):
    """A vLLM folder behind SGLang was refused with `04_train.py --export-only --engine sglang`, also on a host
    without the run's checkpoints (05 --server on the benchmarking host), where that command is refused. The folder's
    trained_from.train_dir decides now: the same run's sglang export beside it, else --export-only when that folder
    holds checkpoints here, else that it needs them."""
    train = tmp_path / "run" / "train"
    prov = {
        "train_dir": str(train),
        "checkpoint": None,
        "step": 4,
        "select_best": "last",
        "selected_step": 4,
    }
    vl = export_drafter(
        drafter(), tmp_path / "run" / "drafter-vllm", "vllm", [2, 15, 27], LLAMA30, provenance=prov
    )
    head = (
        f"{vl / 'config.json'}: this folder is for vllm, but sglang serves it; sglang reads its layer ids [2, 15, 27] "
        f"in another convention (one layer off for Llama verifiers). Use the sglang export: "
    )
    with pytest.raises(UserError) as e:
        check_export_folder(vl, serving_engine="sglang")
    assert str(e.value) == head + (
        f"04_train.py --export-only --engine sglang needs the run's checkpoints, and "
        f"{train / 'checkpoints'} (trained_from in {vl / 'eagle3_train.json'}) holds none "
        f"on this machine: run it where they are"
    )
    (train / "checkpoints").mkdir(parents=True)
    (train / "checkpoints" / "step_00000004.pt").write_bytes(b"")
    with pytest.raises(UserError) as e:
        check_export_folder(vl, serving_engine="sglang")
    assert str(e.value) == head + (
        f"04_train.py --export-only --engine sglang writes it from {train / 'checkpoints'} "
        f"(with the run's config)"
    )
    sg = export_drafter(
        drafter(),
        tmp_path / "run" / "drafter-sglang",
        "sglang",
        [2, 15, 27],
        LLAMA30,
        provenance=prov,
    )
    with pytest.raises(UserError) as e:
        check_export_folder(vl, serving_engine="sglang")
    assert str(e.value) == head + f"{sg} (the same run's, beside this one)"


def test_server_bench_checks_the_servers_draft_folder(tmp_path, monkeypatch):
    from _ddp_worker import make_tiny_run

    from eagle3.config import load_config
    from eagle3.decoding import server_checks as server_bench
    from eagle3.verifier.load import weights_fingerprint

    def draft_folder_warnings(c, url):  # what stage 05 --server passes from its config
        name, fp = c.verifier.display_name(), weights_fingerprint(c.verifier)
        return server_bench.draft_folder_warnings(url, name, fp, c.shards_dir)

    cfg = load_config(make_tiny_run(tmp_path / "run"))  # shards: Llama, 6 layers, HF aux [2, 3, 4]
    # the run's own exports: its verifier's name and weights fingerprint (verifier.path holds no weight file here)
    six = {**LLAMA30, "num_layers": 6, "name": "synthetic", "weights": "sha256:" + "c" * 64}
    good = export_drafter(drafter(), tmp_path / "sg", "sglang", [2, 3, 4], six, ttt_length=7)
    off = export_drafter(drafter(), tmp_path / "off", "sglang", [1, 3, 4], six, ttt_length=7)
    vl = export_drafter(drafter(), tmp_path / "vl", "vllm", [2, 3, 4], six, ttt_length=7)
    other = export_drafter(
        drafter(),
        tmp_path / "other",
        "sglang",
        [2, 3, 4],
        {**six, "name": "tiny/llama-30"},
        ttt_length=7,
    )
    path = {"steps": 3}  # SGLang's /server_info names the draft folder and --speculative-num-steps
    monkeypatch.setattr(
        server_bench,
        "server_info",
        lambda url, timeout=30.0: {
            "speculative_draft_model_path": str(path["p"]),
            **({"speculative_num_steps": path["steps"]} if path["steps"] is not None else {}),
        },
    )
    path["p"] = good
    w, rec = draft_folder_warnings(cfg, "http://x")
    no_weights = (
        "verifier.path holds no weight file on this machine: 05 did not check that the drafter was trained on "
        "the weights at verifier.path, only the name 'synthetic'; check that verifier.path is the model its "
        "shards were captured from"
    )
    assert w == rec["not_checked"] == [no_weights] and rec["readable"] is True
    path["p"] = off
    w, _rec = draft_folder_warnings(cfg, "http://x")
    assert (
        len(w) == 2 and w[1] == no_weights and "HF layers [1, 3, 4]" in w[0] and "[2, 3, 4]" in w[0]
    )
    # a server_info without speculative_num_steps: the trained ttt_length was not compared, and that is said
    path["p"], path["steps"] = good, None
    w, rec = draft_folder_warnings(cfg, "http://x")
    assert (
        w
        == rec["not_checked"]
        == [
            no_weights,
            (
                f"http://x/server_info names no integer speculative_num_steps: 05 did not check the drafter's trained "
                f"ttt_length ({good / 'eagle3_train.json'}) against the draft tokens the server drafts a step; check that its "
                f"--speculative-num-steps is at most that ttt_length"
            ),
        ]
    )
    path["steps"] = 3
    # a drafter exported for another verifier: said, as offline 05 says it (--server never compared them)
    path["p"] = other
    w, rec = draft_folder_warnings(cfg, "http://x")
    assert (
        w
        == [
            f"drafter {other / 'eagle3_train.json'} was exported for verifier 'tiny/llama-30', benchmarking it "
            f"with 'synthetic'"
        ]
        and rec["not_checked"] == []
    )
    path["p"] = vl
    with pytest.raises(UserError, match="this folder is for vllm, but sglang serves it"):
        draft_folder_warnings(cfg, "http://x")
    # not readable here (the server on another host): not checked, and said so (it used to return [] silently)
    path["p"] = tmp_path / "not-here"
    w, rec = draft_folder_warnings(
        SimpleNamespace(shards_dir=tmp_path, verifier=cfg.verifier), "http://x"
    )
    assert len(w) == 1 and w[0].startswith(
        f"the server's draft folder {tmp_path / 'not-here'} (http://x/server_info "
        f"speculative_draft_model_path) is not readable on this machine"
    )
    assert rec == {
        "url": "http://x",
        "engine": "sglang",
        "path": str(tmp_path / "not-here"),
        "speculative_num_steps": 3,
        "readable": False,
        "not_checked": w,
    }
    # readable, but without the shards' data_config.json: checked against the folder's own record only (said in one
    # warning line, as offline 05 says it, and recorded)
    path["p"] = good
    w, rec = draft_folder_warnings(
        SimpleNamespace(shards_dir=tmp_path, verifier=cfg.verifier), "http://x"
    )
    assert (
        w
        == rec["not_checked"]
        == [
            no_weights,
            f"{tmp_path / 'data_config.json'} not found: 05 checked the layers SGLang "
            f"captures against the folder's own record only, not against the shards'; "
            f"compare its eagle3_train.json aux_layers_hf with the shards' "
            f"data_config.json aux_layers",
        ]
    )


def test_kimi_drafter_export_size_bf16_vs_fp32():
    """README figure: the Kimi-K2.5 drafter of configs/kimi-k2.5.yaml exports 985,427,968 weights
    (embedding omitted) = 1.97 GB in bf16, 3.94 GB in fp32 (shapes on the meta device, no weights)."""
    from eagle3.config import load_config
    from eagle3.export.sglang import KEYS as SGLANG_KEYS

    c = load_config(Path(__file__).resolve().parents[2] / "configs" / "kimi-k2.5.yaml").drafter
    a = DrafterArgs(
        hidden_size=c.hidden_size,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        intermediate_size=c.intermediate_size,
        rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta,
        max_position_embeddings=c.max_position_embeddings,
        draft_vocab_size=32000,
        target_vocab_size=163840,
        target_hidden_size=7168,
    )
    with torch.device("meta"):
        sd = Eagle3Drafter(a).state_dict()
    n = sum(sd[k].numel() for k in SGLANG_KEYS if sd[k].is_floating_point())
    # fc 3*7168*7168 + q 14336*8192 + k,v 2*14336*1024 + o 8192*7168 + mlp 3*7168*18432 + 4 norms + lm_head 32000*7168
    assert (
        n
        == 154140672 + 117440512 + 2 * 14680064 + 58720256 + 396361728 + 4 * 7168 + 229376000
        == 985427968
    )
    assert (round(2 * n / 1e9, 2), round(4 * n / 1e9, 2)) == (1.97, 3.94)


def test_export_refuses_to_replace_other_engines_folder_or_foreign_files(tmp_path):
    d = drafter()
    out = export_drafter(d, tmp_path / "drafter-sglang", "sglang", [2, 15, 27], LLAMA30)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(
        UserError, match=r"holds the sglang export; exporting for vllm there would replace it"
    ):
        export_drafter(d, out, "vllm", [2, 15, 27], LLAMA30)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # untouched
    export_drafter(d, out, "sglang", [2, 15, 27], LLAMA30)  # same engine: re-export replaces it
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(UserError, match=r"not an eagle3-train export"):
        export_drafter(d, foreign, "sglang", [2, 15, 27], LLAMA30)
    assert (foreign / "notes.txt").read_text() == "keep me"
    (tmp_path / "empty").mkdir()
    export_drafter(d, tmp_path / "empty", "vllm", [2, 15, 27], LLAMA30)  # an empty folder is fine


# ---- issue 26 item 3: the vocab map against each engine's real loader rule -----------------------
def _drafter_with_vocab(draft_v: int, seed: int = 0) -> Eagle3Drafter:
    """A drafter of the test_export shape with ``draft_v`` draft ids over the verifier vocab 50."""
    torch.manual_seed(seed)
    a = DrafterArgs(
        hidden_size=24,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=6,
        intermediate_size=40,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=512,
        draft_vocab_size=draft_v,
        target_vocab_size=50,
        target_hidden_size=24,
    )
    d = Eagle3Drafter(a)
    ids = torch.tensor(sorted(torch.randperm(50)[:draft_v].tolist()))
    t2d = torch.zeros(50, dtype=torch.bool)
    t2d[ids] = True
    d.set_vocab_map(ids - torch.arange(draft_v), t2d)
    with torch.no_grad():
        d.embed_tokens.weight.normal_()
    return d


def vllm_eagle3_vocab_load(folder: Path, verifier_vocab: int) -> torch.Tensor:
    """vLLM 0.33's handling of the vocab map, step by step (``vllm/model_executor/models/llama_eagle3.py``):
    ``Eagle3LlamaForCausalLM.__init__`` creates ``draft_id_to_target_id`` (zeros ``[draft_V]``) only when
    ``config.draft_vocab_size != model_config.get_vocab_size()``; ``load_weights`` skips ``t2d`` and renames
    ``d2t`` to that parameter, which ``AutoWeightsLoader`` refuses when it does not exist;
    ``compute_logits`` scatters draft logits to ``arange(draft_V) + draft_id_to_target_id``, or with no
    parameter asserts the logits already have ``config.vocab_size`` columns. Returns the target id of each
    draft id as served."""
    cfg = json.loads((folder / "config.json").read_text())
    draft_v = cfg["draft_vocab_size"]  # speculators update_eagle3 copies it into the draft config
    param = torch.zeros(draft_v, dtype=torch.long) if draft_v != verifier_vocab else None
    for name, w in load_file(str(folder / "model.safetensors")).items():
        if "t2d" in name:
            continue
        if "d2t" in name:
            if param is None:
                raise ValueError(
                    "There is no module or parameter named 'draft_id_to_target_id' in Eagle3LlamaForCausalLM"
                )
            param = w
    if param is None:
        assert (
            cfg["transformer_layer_config"]["vocab_size"] == draft_v
        )  # compute_logits' shape assertion
        return torch.arange(draft_v)
    return torch.arange(draft_v) + param


def sglang_eagle3_vocab_load(folder: Path) -> torch.Tensor:
    """SGLang 0.5.23 (``sglang/srt/models/llama_eagle3.py`` ``LlamaForCausalLMEagle3.load_weights``):
    ``hot_token_id = d2t + arange(len(d2t))`` when ``d2t`` is present (``t2d`` skipped); without it
    ``hot_token_id`` is None and the worker uses draft ids as target ids (``eagle_worker_v2``). The
    draft lm_head has ``draft_vocab_size`` rows."""
    cfg = json.loads((folder / "config.json").read_text())
    hot = None
    for name, w in load_file(str(folder / "model.safetensors")).items():
        if "d2t" in name:
            hot = w + torch.arange(w.shape[0])
    return hot if hot is not None else torch.arange(cfg["draft_vocab_size"])


@pytest.mark.parametrize(
    "draft_v", [16, 50]
)  # reduced draft vocab, and draft vocab == verifier vocab (03 accepts it)
@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_every_vocab_config_loads_in_each_engine_with_the_drafters_map(tmp_path, engine, draft_v):
    d = _drafter_with_vocab(draft_v)
    want = torch.arange(draft_v) + d.d2t  # target id of each draft id
    out = export_drafter(d, tmp_path / "x", engine, [2, 15, 27], LLAMA30)
    served = vllm_eagle3_vocab_load(out, 50) if engine == "vllm" else sglang_eagle3_vocab_load(out)
    assert torch.equal(served, want)
    keys = set(load_file(str(out / "model.safetensors")))
    assert ({"d2t", "t2d"} <= keys) == (engine == "sglang" or draft_v < 50)
    re = load_exported(out, embed_weight=d.embed_tokens.weight)  # our own loader (05) agrees
    assert torch.equal(re.d2t, d.d2t) and torch.equal(re.t2d, d.t2d)
    assert check_export_folder(out, serving_engine=engine)["warnings"] == []


def test_old_full_vocab_vllm_folder_with_d2t_is_refused_and_reduced_without_d2t(tmp_path):
    """What vLLM refuses (full vocab + d2t) or serves wrongly (reduced vocab, no d2t) our loader refuses."""
    from safetensors.torch import save_file

    d = _drafter_with_vocab(50)
    out = export_drafter(d, tmp_path / "x", "vllm", [2, 15, 27], LLAMA30)
    sd = load_file(str(out / "model.safetensors"))
    save_file({**sd, "d2t": d.d2t.clone(), "t2d": d.t2d.clone()}, str(out / "model.safetensors"))
    with pytest.raises(ValueError, match="draft_id_to_target_id"):
        vllm_eagle3_vocab_load(out, 50)
    with pytest.raises(UserError, match=r"tensor 'd2t' in a full-vocab folder .*vLLM refuses it"):
        load_exported(out, embed_weight=d.embed_tokens.weight)
    d = _drafter_with_vocab(16)
    out = export_drafter(d, tmp_path / "y", "vllm", [2, 15, 27], LLAMA30)
    sd = load_file(str(out / "model.safetensors"))
    del sd["d2t"]
    save_file(sd, str(out / "model.safetensors"))
    assert not torch.equal(
        vllm_eagle3_vocab_load(out, 50), torch.arange(16) + d.d2t
    )  # zeros: silently wrong
    with pytest.raises(
        UserError, match=r"missing required tensor 'd2t' \(draft_vocab_size 16 < vocab_size 50"
    ):
        load_exported(out, embed_weight=d.embed_tokens.weight)


# ---- issue 26 items 4 and 5: SGLang's own start-up rules run on the exported config.json ----------
def _sglang_fns():
    """SGLang 0.5.23's real ``get_context_length``, ``ModelConfig._derive_context_length`` and
    ``_get_and_verify_dtype``, compiled from the installed source (patches/sglang_source.py; None if absent)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "patches"))
    import logging

    import sglang_source as src

    root = src.sglang_root()
    if root is None:
        pytest.skip("SGLang not installed (CI: pip install --no-deps sglang==0.5.23)")
    common, mc = root / "srt/utils/hf_transformers/common.py", root / "srt/configs/model_config.py"
    keys = next(
        n
        for n in __import__("ast").parse(common.read_text()).body
        if getattr(getattr(n, "targets", [None])[0], "id", None) == "CONTEXT_LENGTH_KEYS"
    )
    ns = {}
    exec(compile(__import__("ast").Module(body=[keys], type_ignores=[]), "keys", "exec"), ns)
    get_ctx = src.compile_def(common, "get_context_length", ns)
    env = SimpleNamespace(
        SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=SimpleNamespace(get=lambda: False)
    )
    derive = src.compile_def(
        mc,
        "ModelConfig._derive_context_length",
        {
            "get_context_length": get_ctx,
            "envs": env,
            "is_in_ci": lambda: False,
            "logger": logging.getLogger("sglang-src"),
        },
    )
    dtype_fn = src.compile_def(
        mc,
        "_get_and_verify_dtype",
        {
            "torch": torch,
            "logger": logging.getLogger("sglang-src"),
            "_STR_DTYPE_TO_TORCH_DTYPE": {
                "half": torch.float16,
                "float16": torch.float16,
                "float": torch.float32,
                "float32": torch.float32,
                "bfloat16": torch.bfloat16,
            },
        },
    )
    return get_ctx, derive, dtype_fn


def _sglang_starts(draft_folder: Path, verifier_cfg: dict) -> bool:
    """Whether SGLang's draft ModelConfig accepts the folder: the draft gets the target's derived context
    length (eagle_worker_v2: context_length=target context_len) and ``_derive_context_length`` runs."""
    get_ctx, derive, _ = _sglang_fns()
    draft = SimpleNamespace(**json.loads((draft_folder / "config.json").read_text()))
    me = SimpleNamespace(
        is_draft_model=True,
        hf_text_config=draft,
        hf_config=SimpleNamespace(architectures=draft.architectures),
    )
    try:
        derive(me, get_ctx(SimpleNamespace(**verifier_cfg)))
    except ValueError as e:
        assert "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN" in str(e)
        return False
    return True


def _drafter_ctx(mpe: int, rope_scaling=None) -> Eagle3Drafter:
    a = DrafterArgs(
        hidden_size=24,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=6,
        intermediate_size=40,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=mpe,
        draft_vocab_size=16,
        target_vocab_size=50,
        target_hidden_size=24,
        rope_scaling=rope_scaling,
    )
    d = drafter()
    d2 = Eagle3Drafter(a)
    d2.load_state_dict(d.state_dict())
    return d2


LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@pytest.mark.parametrize(
    "mpe,rope,verifier",
    [
        (2048, None, {"max_position_embeddings": 8192}),  # short: SGLang refuses
        (8192, None, {"max_position_embeddings": 8192}),  # equal: starts
        (16384, None, {"max_position_embeddings": 8192}),  # longer: starts
        (
            2048,
            {"rope_type": "linear", "factor": 4.0},
            {"max_position_embeddings": 8192},
        ),  # 2048 x 4 = 8192: starts
        (
            2048,
            {"rope_type": "linear", "factor": 2.0},
            {"max_position_embeddings": 8192},
        ),  # 4096 < 8192
        (
            8192,
            LLAMA3,
            {"max_position_embeddings": 131072, "rope_scaling": LLAMA3},
        ),  # Llama-3.1 verifier, short draft
        (
            131072,
            LLAMA3,
            {"max_position_embeddings": 131072, "rope_scaling": LLAMA3},
        ),  # the copied default: starts
    ],
)
def test_sglang_draft_context_refused_exactly_when_sglang_refuses_the_exported_folder(
    tmp_path, mpe, rope, verifier
):
    """Issue 26 item 4: our verdict (04 refuses at its start for SGLang) equals SGLang 0.5.23's own start-up check
    on the folder the export writes for that drafter; vLLM gets one warning line naming the key instead."""
    from eagle3.engines.context import check_context_length, draft_context_length
    from eagle3.verifier.load import serving_context_length

    get_ctx = _sglang_fns()[0]
    vctx = serving_context_length(verifier)
    assert vctx == get_ctx(
        SimpleNamespace(**{"rope_scaling": None, **verifier})
    )  # our rule == SGLang's
    d = _drafter_ctx(mpe, rope)
    sg = export_drafter(d, tmp_path / "sg", "sglang", [2, 15, 27], LLAMA30)  # written as asked
    draft = json.loads((sg / "config.json").read_text())
    assert draft_context_length(mpe, rope) == get_ctx(SimpleNamespace(**draft))
    if _sglang_starts(sg, {"rope_scaling": None, **verifier}):
        assert check_context_length(mpe, rope, vctx, "sglang") is None
        assert check_context_length(mpe, rope, vctx, "vllm") is None
    else:
        with pytest.raises(
            UserError,
            match=rf"^drafter.max_position_embeddings: {mpe} gives the draft a context length "
            r"of \d+ tokens, below the verifier's \d+: SGLang 0.5.23 refuses.*"
            r"SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1.*>= \d+",
        ) as e:
            check_context_length(mpe, rope, vctx, "sglang")
        assert "\n" not in str(e.value)
        warning = check_context_length(mpe, rope, vctx, "vllm")
        assert (
            warning.startswith(f"drafter.max_position_embeddings: {mpe} gives")
            and "vLLM caps" in warning
        )


def test_short_context_fix_hint_is_enough(tmp_path):
    """The '>= N' of the refusal makes SGLang start the exported folder."""
    import re

    from eagle3.engines.context import check_context_length

    linear = {"rope_type": "linear", "factor": 2.0}
    with pytest.raises(UserError) as e:
        check_context_length(2048, linear, 8192, "sglang")
    need = int(re.search(r">= (\d+)", str(e.value)).group(1))
    assert need == 4096
    assert check_context_length(need, linear, 8192, "sglang") is None
    ok = export_drafter(_drafter_ctx(need, linear), tmp_path / "sg", "sglang", [2, 15, 27], LLAMA30)
    assert _sglang_starts(ok, {"max_position_embeddings": 8192, "rope_scaling": None})
    short = export_drafter(
        _drafter_ctx(need - 1, linear), tmp_path / "short", "sglang", [2, 15, 27], LLAMA30
    )
    assert not _sglang_starts(short, {"max_position_embeddings": 8192, "rope_scaling": None})
    with pytest.raises(UserError, match=r"^export.engine: unknown engine 'tgi'"):
        check_context_length(2048, None, 8192, "tgi")


@pytest.mark.parametrize(
    "verifier_dtype,export,served",
    [
        ("float32", "auto", torch.bfloat16),
        ("bfloat16", "auto", torch.bfloat16),
        ("float16", "auto", torch.float16),
        (
            "auto",
            "auto",
            torch.bfloat16,
        ),  # verifier.dtype auto: bfloat16 on CUDA, the serving dtype
        (
            "float32",
            "float32",
            torch.float16,
        ),  # asked explicitly: written, and SGLang --dtype auto serves it as fp16 (warned)
    ],
)
def test_sglang_dtype_auto_serves_the_export_as_the_verifier_is_served(
    tmp_path, verifier_dtype, export, served
):
    """Issue 26 item 5, with SGLang's real _get_and_verify_dtype on the exported config.json."""
    from eagle3.export.common import export_dtype

    out = export_drafter(
        drafter(),
        tmp_path / "x",
        "sglang",
        [2, 15, 27],
        LLAMA30,
        dtype=export_dtype(export, verifier_dtype),
    )
    assert _sglang_fns()[2](json.loads((out / "config.json").read_text()), "auto") == served


def test_tensor_of_another_shape_refused_at_export_naming_the_shape_needed(tmp_path):
    d = drafter()
    d.lm_head.weight = nn.Parameter(torch.zeros(16, 12))  # [draft_V, H/2]: not the args' [16, 24]
    with pytest.raises(UserError) as e:
        export_drafter(d, tmp_path / "x", "sglang", [2, 15, 27], LLAMA30)
    assert str(e.value) == (
        "drafter tensor 'lm_head.weight': shape [16, 12], EAGLE-3 export needs "
        "[draft_vocab_size, hidden_size] = [16, 24]"
    )
    assert not (tmp_path / "x").exists()
