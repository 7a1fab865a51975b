"""``04 --export-only`` after the shards are deleted (users free terabytes of hidden states once a drafter is trained):
checkpoints record what the export reads of the shards' ``data_config.json`` (key ``data_config``), so the train folder
and ``data/`` export alone; a checkpoint of before the record needs that one file, and says so. The vLLM export warns
when its ``speculative_tokens`` (``benchmark.steps``) pass the ``ttt_length`` the drafter was trained for."""

from __future__ import annotations

import json
import logging
import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _ddp_worker import make_tiny_run, single_thread  # noqa: E402,F401  (autouse fixture)

from eagle3.config import load_config  # noqa: E402
from eagle3.errors import UserError  # noqa: E402
from eagle3.shards.format import LAYER_INDEX_CONVENTION  # noqa: E402
from eagle3.stages.export import (
    export_for_run,  # noqa: E402
    export_from_checkpoint,  # noqa: E402
)
from eagle3.stages.train import run  # noqa: E402
from eagle3.train import checkpoint as ckpt  # noqa: E402

TRAIN = {"epochs": 1, "batch_size": 2, "eval_every": 1, "ckpt_every": 100}
WEIGHTS = "sha256:" + "a" * 64


def _folder(out: Path) -> dict:
    """The export's files that the engines and 05 read, by name."""
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.name != "eagle3_train.json"}


def test_export_only_works_after_the_shards_are_deleted(tmp_path, caplog):
    """With the shards folder deleted, --export-only stopped at `shards/data_config.json: file not found (02 ... run that
    stage first)` although it reads nothing of the shards but that file's aux layers, verifier and dims. The
    checkpoint's record of them now exports the same folder as with the shards; the config is still checked against
    the record (another verifier, other extract.aux_layers: one line naming the checkpoint), and 05 reads the aux
    layers from the export, not the shards."""
    cfg = load_config(
        make_tiny_run(
            tmp_path / "r",
            n_train=4,
            n_val=2,
            aux_layers=(1, 3, 4),
            verifier_weights=WEIGHTS,
            train=TRAIN,
        )
    )
    run(cfg, device="cpu", export=export_for_run)
    path = ckpt.list_checkpoints(cfg.train_dir)[-1][1]
    assert ckpt.load_checkpoint(path)["data_config"] == {
        "verifier": "synthetic",
        "architecture": "LlamaForCausalLM",
        "num_layers": 6,
        "hidden_size": 16,
        "vocab_size": 48,
        "aux_layers": [1, 3, 4],
        "layer_index_convention": LAYER_INDEX_CONVENTION,
        "last_hidden_state": "post_norm",
        "max_length": 16,
        "verifier_weights": WEIGHTS,
    }
    with_shards = _folder(export_from_checkpoint(cfg))
    meta = json.loads((cfg.export_dir / "eagle3_train.json").read_text())

    shutil.rmtree(cfg.shards_dir)
    with caplog.at_level(logging.INFO, logger="eagle3.stages.export"):
        out = export_from_checkpoint(cfg)
    assert (
        _folder(out) == with_shards
    )  # config.json (aux layers, verifier), weights, vocab map: the same bytes
    again = json.loads((out / "eagle3_train.json").read_text())
    assert (
        again == meta
        and again["aux_layers_hf"] == [1, 3, 4]
        and again["verifier"]["weights"] == WEIGHTS
    )
    assert any("key 'data_config', recorded at training" in m for m in caplog.messages)

    from eagle3.decoding.checks import resolve_aux_layers

    assert resolve_aux_layers(out, cfg.shards_dir, None) == ([1, 3, 4], [])  # 05: no shards needed

    other = load_config(tmp_path / "r" / "run.yaml", ["verifier.name=other"])
    with pytest.raises(
        UserError,
        match=rf"^{path} \(key 'data_config'\): verifier \(verifier.name / verifier.path\) 'synthetic' "
        r"-> 'other'; re-run 02_extract_hidden.py$",
    ):
        export_from_checkpoint(other)
    aux = load_config(tmp_path / "r" / "run.yaml", ["extract.aux_layers=[2, 3, 4]"])
    with pytest.raises(UserError) as e:
        export_from_checkpoint(aux)
    assert str(e.value) == (
        f"{path} (key 'data_config'): extract.aux_layers [1, 3, 4] -> [2, 3, 4]; "
        f"re-run 02_extract_hidden.py"
    )


def test_export_only_of_an_older_checkpoint_without_the_shards_names_the_missing_file(tmp_path):
    """A checkpoint of before the record exports as it did beside the shards' data_config.json; without it, one line
    names the file, the checkpoint without the record, and that only that file (not the shards) is needed."""
    cfg = load_config(make_tiny_run(tmp_path / "r", n_train=4, n_val=2, train=TRAIN))
    run(cfg, device="cpu", export=export_for_run)
    path = ckpt.list_checkpoints(cfg.train_dir)[-1][1]
    state = ckpt.load_checkpoint(path)
    del state["data_config"]
    torch.save(state, path)
    assert export_from_checkpoint(cfg).is_dir()  # the shards' file still there: today's export
    dc = cfg.shards_dir / "data_config.json"
    kept = dc.read_bytes()
    shutil.rmtree(cfg.shards_dir)
    with pytest.raises(UserError) as e:
        export_from_checkpoint(cfg)
    assert str(e.value) == (
        f"{dc}: file not found, and {path} has no record of it (checkpoint key 'data_config': "
        f"written by 04 since 2026-12-05g, this checkpoint is older), so --export-only needs the "
        f"shards' data_config.json for their aux layers, verifier and dims: put that one file back "
        f"at {dc} (the shard files are not read), or re-run 02_extract_hidden.py"
    )
    dc.parent.mkdir(parents=True)
    dc.write_bytes(kept)  # that file alone, no shard: exports
    assert export_from_checkpoint(cfg).is_dir()


def test_vllm_export_warns_when_speculative_tokens_pass_the_trained_ttt_length(tmp_path, caplog):
    """benchmark.steps 5 on a drafter trained with train.ttt_length 3 went into the vLLM folder's speculative_tokens
    without a word (vLLM then drafts positions 4 and 5, never trained). Training's export and --export-only now warn
    in one line naming both values and where each comes from; within ttt_length, or for SGLang, nothing is said."""
    yaml = make_tiny_run(tmp_path / "r", n_train=4, n_val=2, train=TRAIN)
    cfg = load_config(yaml, ["export.engine=vllm", "benchmark.steps=5"])
    with caplog.at_level(logging.WARNING, logger="eagle3.stages.export"):
        run(cfg, device="cpu", export=export_for_run)
    conf = cfg.export_dir / "config.json"
    tail = (
        "the drafter was trained for: vLLM drafts positions 4..5, never trained, at low acceptance; export with "
        "benchmark.steps 3 (04_train.py --export-only --engine vllm --set benchmark.steps=3), or train with "
        "train.ttt_length 5"
    )
    want = f"export: speculative_tokens 5 (benchmark.steps) in {conf} is more than the ttt_length 3 (train.ttt_length) {tail}"
    assert [m for m in caplog.messages if "speculative_tokens" in m] == [want]
    sc = json.loads(conf.read_text())["speculators_config"]["proposal_methods"][0]
    assert (
        sc["speculative_tokens"] == 5
        and json.loads((cfg.export_dir / "eagle3_train.json").read_text())["ttt_length"] == 3
    )
    report = json.loads((cfg.train_dir / "train_report.json").read_text())
    assert want in report["warnings"]
    caplog.clear()
    name = ckpt.list_checkpoints(cfg.train_dir)[-1][1].name
    with caplog.at_level(logging.WARNING, logger="eagle3.stages.export"):
        export_from_checkpoint(cfg)
        export_from_checkpoint(load_config(yaml, ["export.engine=vllm", "benchmark.steps=3"]))
        export_from_checkpoint(
            load_config(
                yaml,
                [
                    "export.engine=sglang",
                    "benchmark.steps=5",
                    f"export.output_dir={tmp_path / 'sg'}",
                ],
            )
        )
    assert [m for m in caplog.messages if "speculative_tokens" in m] == [
        f"export: speculative_tokens 5 (benchmark.steps) in {conf} is more than the ttt_length 3 (train.ttt_length of "
        f"{name}) {tail}"
    ]


def test_export_only_without_the_shards_says_when_the_record_has_no_weights_fingerprint(
    tmp_path, caplog
):
    """A checkpoint whose data_config record has no verifier_weights (shards captured before 2026-12-05f) skipped the
    weights comparison in silence when --export-only ran without the shards, beside a verifier.path with weight files
    that could be any model of that name. One warning line now says so (as 03/04's check_verifier says it of the
    shards' data_config.json); no weight file at verifier.path is nothing to compare (no line), as before."""
    cfg = load_config(make_tiny_run(tmp_path / "r", n_train=4, n_val=2, train=TRAIN))
    run(cfg, device="cpu", export=export_for_run)
    path = ckpt.list_checkpoints(cfg.train_dir)[-1][1]
    assert "verifier_weights" not in ckpt.load_checkpoint(path)["data_config"]
    shutil.rmtree(cfg.shards_dir)
    with caplog.at_level(logging.WARNING, logger="eagle3.stages.export"):
        export_from_checkpoint(cfg)
    assert not [
        m for m in caplog.messages if "verifier_weights" in m
    ]  # no weight file here: nothing to compare
    weights = Path(cfg.verifier.path)
    weights.mkdir()
    (weights / "model.safetensors").write_bytes(b"\0" * 4096)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="eagle3.stages.export"):
        assert export_from_checkpoint(cfg).is_dir()
    assert [m for m in caplog.messages if "verifier_weights" in m] == [
        f"{path} (key 'data_config'): records no verifier_weights: the weights at verifier.path "
        f"'{cfg.verifier.path}' were not checked against the model the shards were captured from, only the name "
        f"'synthetic'; a verifier.path pointed at another model of the same shapes would train against its lm_head "
        f"without an error: check that it is the model 02 captured from, or re-run 02 to record its fingerprint"
    ]
