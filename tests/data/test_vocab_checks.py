"""Every reader of a draft vocab map refuses a bad one (issue 11 item 3): duplicate, out-of-range,
absolute or unsorted target ids, a ``t2d`` that is not the set ``d2t`` describes, and sizes that
differ from the config; the resume refusal names the real config key."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _ddp_worker import make_tiny_run, single_thread  # noqa: E402,F401  (autouse fixture)

from eagle3.config import load_config  # noqa: E402
from eagle3.data.vocab import check_vocab_map  # noqa: E402
from eagle3.drafter.args import DrafterArgs
from eagle3.drafter.model import Eagle3Drafter  # noqa: E402
from eagle3.errors import UserError  # noqa: E402
from eagle3.train import checkpoint as ckpt  # noqa: E402
from eagle3.train import resume_checks  # noqa: E402

V, DV = 8, 4
GOOD_TARGETS = [1, 3, 4, 6]


def _map(targets, marked=None):
    """d2t offsets for the given target id of each draft id; t2d marking ``marked`` (default: targets)."""
    d2t = torch.tensor(targets, dtype=torch.int64) - torch.arange(len(targets))  # [dV]
    t2d = torch.zeros(V, dtype=torch.bool)  # [V]
    t2d[torch.tensor(marked if marked is not None else [t for t in targets if 0 <= t < V])] = True
    return d2t, t2d


BAD = {
    # two draft ids map to target 3; t2d marks 4 ids so that the old count check passed
    "duplicate": (
        *_map([1, 3, 3, 6], marked=[1, 3, 6, 7]),
        r"draft ids 1 and 2 both map to target id 3",
    ),
    "out_of_range": (*_map([1, 3, 4, 9]), r"draft id 3 maps to target id 9, outside 0\.\.7"),
    "absolute": (torch.tensor(GOOD_TARGETS), _map(GOOD_TARGETS)[1], r"absolute target ids"),
    "unsorted": (
        *_map([1, 4, 3, 6]),
        r"sorted by target id.*draft id 1 maps to 4 and draft id 2 to 3",
    ),
    "t2d_mismatch": (
        _map(GOOD_TARGETS)[0],
        _map(GOOD_TARGETS, marked=[1, 3, 4, 7])[1],
        r"key 't2d'.*target id 6",
    ),
    "d2t_int32": (
        _map(GOOD_TARGETS)[0].int(),
        _map(GOOD_TARGETS)[1],
        r"key 'd2t': expected a 1-D int64",
    ),
}


def test_good_map_passes_every_check():
    d2t, t2d = _map(GOOD_TARGETS)
    check_vocab_map(d2t, t2d, target_vocab_size=V, draft_vocab_size=DV)
    check_vocab_map(
        torch.zeros(V, dtype=torch.int64), torch.ones(V, dtype=torch.bool)
    )  # identity map


@pytest.mark.parametrize("case", sorted(BAD))
def test_check_vocab_map_refuses(case):
    d2t, t2d, msg = BAD[case]
    with pytest.raises(UserError, match=msg):
        check_vocab_map(d2t, t2d, "m.pt", target_vocab_size=V, draft_vocab_size=DV)


def _drafter() -> Eagle3Drafter:
    torch.manual_seed(0)
    a = DrafterArgs(
        hidden_size=8,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=4,
        intermediate_size=16,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=32,
        draft_vocab_size=DV,
        target_vocab_size=V,
        target_hidden_size=8,
    )
    d = Eagle3Drafter(a)
    d.set_vocab_map(*_map(GOOD_TARGETS))
    return d


@pytest.mark.parametrize("case", sorted(BAD))
def test_drafter_set_vocab_map_refuses(case):
    d2t, t2d, msg = BAD[case]
    with pytest.raises(UserError, match=msg):
        _drafter().set_vocab_map(d2t, t2d)


@pytest.mark.parametrize(
    "case", ["duplicate", "unsorted", "absolute", "t2d_mismatch", "out_of_range"]
)
def test_vocab_map_file_refuses(tmp_path, case):
    from eagle3.data.vocab import load_vocab_map

    d2t, t2d, msg = BAD[case]
    p = tmp_path / "vocab_map.pt"
    torch.save({"d2t": d2t, "t2d": t2d, "target_vocab_size": V, "draft_vocab_size": DV}, p)
    with pytest.raises(UserError, match=msg):
        load_vocab_map(p)


@pytest.mark.parametrize(
    "case", ["duplicate", "unsorted", "absolute", "t2d_mismatch", "out_of_range"]
)
def test_exported_folder_refuses(tmp_path, case):
    from eagle3.export.reader import load_exported
    from eagle3.export.writer import export_drafter

    d = _drafter()
    info = dict(
        name="tiny", architecture="LlamaForCausalLM", num_layers=8, hidden_size=8, vocab_size=V
    )
    out = export_drafter(d, tmp_path / "x", "sglang", [2, 4, 5], info)
    sd = load_file(str(out / "model.safetensors"))
    sd["d2t"], sd["t2d"], msg = BAD[case]
    save_file(sd, str(out / "model.safetensors"))
    with pytest.raises(UserError, match=msg):
        load_exported(out, embed_weight=d.embed_tokens.weight)


def test_save_vocab_map_refuses_bad_map(tmp_path):
    from eagle3.data.vocab import save_vocab_map

    d2t, t2d, msg = BAD["duplicate"]
    with pytest.raises(UserError, match=msg):
        save_vocab_map(tmp_path / "vocab_map.pt", d2t, t2d)
    assert not (tmp_path / "vocab_map.pt").exists()


# ---- against the config ------------------------------------------------------------------------
def test_fresh_training_refuses_draft_size_other_than_the_data(tmp_path):
    """data prepared with 24 draft ids, config asks 32: error naming data.draft_vocab_size, nothing written."""
    from eagle3.stages.train import run

    cfg = load_config(make_tiny_run(tmp_path, draft_vocab=24), ["data.draft_vocab_size=32"])
    with pytest.raises(
        UserError,
        match=r"vocab_map.pt: key 'draft_vocab_size': the map has 24 draft tokens but "
        r"data.draft_vocab_size is 32",
    ):
        run(cfg, device="cpu")
    assert not ckpt.list_checkpoints(cfg.train_dir) and not cfg.export_dir.exists()


def test_export_only_refuses_draft_size_other_than_the_data(tmp_path):
    from eagle3.stages.export import export_from_checkpoint
    from eagle3.stages.train import run

    path = make_tiny_run(tmp_path, draft_vocab=24, train={"epochs": 1})
    run(load_config(path), stop_after=1, max_steps=2, device="cpu")
    with pytest.raises(UserError, match=r"data.draft_vocab_size is 32"):
        export_from_checkpoint(load_config(path, ["data.draft_vocab_size=32"]))


def test_export_only_refuses_a_vocab_map_of_the_same_size_it_was_not_trained_with(tmp_path):
    """03 re-run on other shards gives a map of the same size with other ids: `04 --resume` refused it, but `04
    --export-only` exported the checkpoint with the new d2t beside lm_head rows trained for the old one (trial
    2026-12-05g): every draft token served as another token. Now refused before anything is written; with the map
    it was trained with it exports that map."""
    from eagle3.data.vocab import load_vocab_map, save_vocab_map
    from eagle3.stages.export import export_from_checkpoint
    from eagle3.stages.train import run

    path = make_tiny_run(tmp_path, draft_vocab=24, train={"epochs": 1})
    cfg = load_config(path)
    run(cfg, stop_after=1, max_steps=2, device="cpu")
    vm_path = cfg.data_dir / "vocab_map.pt"
    trained = load_vocab_map(vm_path)
    t2d = trained["t2d"].clone()
    ids = t2d.nonzero().flatten()
    t2d[ids[-1]] = (
        False  # the last draft token becomes another, unused target id: same size, other map
    )
    t2d[next(i for i in range(t2d.numel()) if not trained["t2d"][i])] = True
    other = t2d.nonzero().flatten()
    save_vocab_map(vm_path, other - torch.arange(other.numel()), t2d)
    with pytest.raises(UserError) as e:
        export_from_checkpoint(cfg)
    assert str(e.value) == (
        f"{ckpt.ckpt_path(cfg.train_dir, 1)}: {vm_path} is not the draft vocab map this checkpoint "
        "was trained with: its lm_head rows would stand for other tokens; train a new run (a new "
        "train.output_dir), or re-run 03_prepare_data.py with the old data settings"
    )
    assert not cfg.export_dir.exists()
    save_vocab_map(vm_path, trained["d2t"], trained["t2d"])
    out = export_from_checkpoint(cfg)
    assert torch.equal(load_file(out / "model.safetensors")["d2t"], trained["d2t"])


def test_export_only_refuses_a_checkpoint_without_data_inputs_of_another_draft_size(tmp_path):
    """A checkpoint that records no data_inputs (written before the record) is compared by its drafter_args: a draft
    vocab size other than the vocab map's is one line naming both, nothing written."""
    from eagle3.stages.export import export_from_checkpoint
    from eagle3.stages.train import run

    path = make_tiny_run(tmp_path, draft_vocab=24, train={"epochs": 1})
    cfg = load_config(path)
    run(cfg, stop_after=1, max_steps=2, device="cpu")
    step = ckpt.ckpt_path(cfg.train_dir, 1)
    state = torch.load(step, map_location="cpu", weights_only=True)
    del state["data_inputs"]
    state["drafter_args"]["draft_vocab_size"] = 20
    torch.save(state, step)
    with pytest.raises(UserError) as e:
        export_from_checkpoint(cfg)
    assert str(e.value) == (
        f"{step}: drafter_args.draft_vocab_size 20 differs from {cfg.data_dir / 'vocab_map.pt'} (24)"
    )
    assert not cfg.export_dir.exists()


def test_export_only_refuses_a_checkpoint_whose_model_state_is_not_the_drafters(tmp_path):
    """The checkpoint's state must be the drafter's whole trained state: a tensor it has not, or a trainable one
    absent, is the checkpoint's one line (``_model_state_problem``), nothing written."""
    from eagle3.stages.export import export_from_checkpoint
    from eagle3.stages.train import run

    path = make_tiny_run(tmp_path, draft_vocab=24, train={"epochs": 1})
    cfg = load_config(path)
    run(cfg, stop_after=1, max_steps=2, device="cpu")
    step = ckpt.ckpt_path(cfg.train_dir, 1)
    state = torch.load(step, map_location="cpu", weights_only=True)
    good = dict(state["model"])
    state["model"]["bogus.weight"] = torch.zeros(2)
    torch.save(state, step)
    with pytest.raises(UserError) as e:
        export_from_checkpoint(cfg)
    assert str(e.value) == f"{step}: key 'model.bogus.weight' unexpected"
    state["model"] = {k: v for k, v in good.items() if k != "fc.weight"}
    torch.save(state, step)
    with pytest.raises(UserError) as e:
        export_from_checkpoint(cfg)
    assert str(e.value) == f"{step}: key 'model.fc.weight' missing"
    assert not cfg.export_dir.exists()


@pytest.mark.parametrize(
    "key,named",
    [
        ("draft_vocab_size", "data.draft_vocab_size"),
        ("target_hidden_size", "verifier.path"),
        ("hidden_size", "drafter.hidden_size"),
    ],
)
def test_resume_refusal_names_a_real_config_key(key, named):
    from eagle3.config import RunConfig

    msg = resume_checks.drafter_args_problem({key: 8000}, {key: 32000})
    assert named in msg
    for token in msg.replace("(", " ").replace(")", " ").replace(",", " ").split():
        if token.count(".") == 1 and token.split(".")[0] in RunConfig.model_fields:
            section, field = token.split(".")
            sub = RunConfig.model_fields[section].annotation
            assert field in sub.model_fields, f"{token} is not a config key"


@pytest.mark.parametrize(
    "change, msg",
    [
        (dict(target_vocab_size=9), r"field 'target_vocab_size' records 9 but the tensors have 8"),
        (dict(draft_vocab_size=5), r"field 'draft_vocab_size' records 5 but the tensors have 4"),
        (dict(draft_vocab_size="4"), r"field 'draft_vocab_size' should be a valid integer"),
        (dict(t2d=None), r"field 't2d' should be an instance of Tensor"),
    ],
)
def test_vocab_map_file_records_are_the_tensors(tmp_path, change, msg):
    from eagle3.data.vocab import load_vocab_map

    d2t, t2d = _map(GOOD_TARGETS)
    p = tmp_path / "vocab_map.pt"
    torch.save({"d2t": d2t, "t2d": t2d, "target_vocab_size": V, "draft_vocab_size": DV}, p)
    assert load_vocab_map(p)["draft_vocab_size"] == DV
    obj = {"d2t": d2t, "t2d": t2d, "target_vocab_size": V, "draft_vocab_size": DV, **change}
    torch.save({k: v for k, v in obj.items() if v is not None}, p)
    if "t2d" in change:
        msg = r"field 't2d' is missing; re-run 03_prepare_data.py"
    with pytest.raises(UserError, match=rf"vocab_map.pt: {msg}"):
        load_vocab_map(p)
