"""configs/kimi-k2.5.yaml: valid for the RunConfig schema, consistent with Kimi-K2.5's shapes, fully commented."""

from __future__ import annotations

import re

import pytest
from conftest import ROOT

from eagle3.config import load_config
from eagle3.engines.layers import check_aux_layers, engine_layer_ids, hf_layers_from_engine
from eagle3.errors import UserError
from eagle3.verifier.load import verifier_dims

CFG = ROOT / "configs" / "kimi-k2.5.yaml"

#: Kimi-K2.5's config.json shape (FIELD-NOTES section 6): wrapper + nested DeepseekV3-style text_config.
K25_CONFIG = {
    "architectures": ["KimiK25ForConditionalGeneration"],
    "model_type": "kimi_k25",
    "text_config": {
        "model_type": "kimi_k2",
        "num_hidden_layers": 61,
        "hidden_size": 7168,
        "vocab_size": 163840,
        "num_attention_heads": 64,
        "num_key_value_heads": 64,
        "kv_lora_rank": 512,
        "q_lora_rank": 1536,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "intermediate_size": 18432,
        "rms_norm_eps": 1e-6,
        "rope_theta": 50000.0,
        "max_position_embeddings": 262144,
    },
}


def test_loads_with_production_values():
    cfg = load_config(CFG)
    assert cfg.verifier.path == "/models/Kimi-K2.5"
    assert cfg.verifier.trust_remote_code is True
    assert cfg.verifier.gguf_file is None
    assert cfg.extract.backend == "sglang"
    assert cfg.extract.aux_layers == [3, 31, 59]
    assert cfg.extract.max_length == 4096
    assert cfg.extract.capture_dir and cfg.extract.sglang_url
    assert cfg.data.draft_vocab_size == 32000
    d = cfg.drafter
    assert (
        d.hidden_size,
        d.num_attention_heads,
        d.num_key_value_heads,
        d.head_dim,
        d.intermediate_size,
    ) == (7168, 64, 8, 128, 18432)
    assert d.num_attention_heads % d.num_key_value_heads == 0  # GQA groups must divide
    assert str(cfg.shards_dir) == "/data/eagle3/kimi-k2.5/shards"
    assert str(cfg.export_dir) == "/data/eagle3/kimi-k2.5/drafter-sglang"


def test_shapes_match_kimi_text_config():
    cfg = load_config(CFG)
    dims = verifier_dims(K25_CONFIG)
    assert dims["num_layers"] == 61 and dims["architecture"] == "KimiK25ForConditionalGeneration"
    assert cfg.drafter.hidden_size == dims["hidden_size"] == 7168
    assert cfg.drafter.intermediate_size == dims["intermediate_size"]
    assert cfg.data.draft_vocab_size < dims["vocab_size"] == 163840
    assert check_aux_layers(cfg.extract.aux_layers, dims["num_layers"]) == [3, 31, 59]


def test_aux_layers_to_engine_ids():
    """[3, 31, 59] (HF) -> SGLang DeepSeek rule keeps them (first id != 1); vLLM keeps them; round trip."""
    layers = load_config(CFG).extract.aux_layers
    arch = K25_CONFIG["architectures"][0]
    assert engine_layer_ids(layers, "sglang", arch) == [3, 31, 59]
    assert engine_layer_ids(layers, "vllm", arch) == [3, 31, 59]
    assert hf_layers_from_engine([3, 31, 59], "sglang", arch) == layers


def test_every_setting_is_commented():
    """Each `key: value` line carries a `#` comment (the file is the documentation of the production run)."""
    bad = []
    for n, line in enumerate(CFG.read_text().splitlines(), 1):
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        if re.match(r"^[A-Za-z_]+:\s*$", s):  # a section header ("extract:") needs no comment
            continue
        if "#" not in s:
            bad.append(f"line {n}: {s}")
    assert bad == []


def test_override_and_bad_value():
    cfg = load_config(CFG, ["extract.sglang_url=http://10.0.0.2:30000", "train.max_steps=10"])
    assert cfg.extract.sglang_url == "http://10.0.0.2:30000" and cfg.train.max_steps == 10
    with pytest.raises(UserError, match="extract.aux_layers"):
        load_config(CFG, ["extract.aux_layers=[31, 3, 59]"])


def test_benchmark_servers_are_on_two_nodes():
    """EAGLE-3 server and baseline each fill an 8-GPU node with Kimi-K2.5 (~600 GB of weights): the config's two
    benchmark URLs name two hosts, not one machine's two ports (fresh-user trial 2026-12-05e)."""
    from urllib.parse import urlparse

    urls = load_config(CFG).benchmark.server_urls
    hosts = [urlparse(u).hostname for u in urls]
    assert len(hosts) == 2 and hosts[0] != hosts[1], hosts
    assert not {"127.0.0.1", "localhost"} & set(hosts)


def test_serving_node_launch_commands_listen_beyond_localhost():
    """Every plain SGLang launch in the README's production section and the Kimi config is reached from another host
    (stage 01's serving nodes, the benchmark's two nodes): SGLang 0.5.23 listens on 127.0.0.1 unless --host says
    otherwise, so each command states --host 0.0.0.0 (trial 2026-12-05e)."""
    readme = (ROOT / "README.md").read_text()
    section = readme[
        readme.index("## Production: Kimi-K2.5 with SGLang") : readme.index("## Conventions")
    ]
    texts = {"README.md": section, CFG.name: CFG.read_text()}
    found = 0
    for name, text in texts.items():
        flat = " ".join(text.replace("\\\n", " ").split())
        for cmd in flat.split("python -m sglang.launch_server")[1:]:
            cmd = cmd.split("`")[0].split("#")[0]
            found += 1
            assert "--host 0.0.0.0" in cmd, (name, cmd)
    assert found == 4  # README: step 1, step 6 (EAGLE-3 + baseline); config: prompts.server.urls
