"""05 checks the benchmarked drafter's draft vocab against the run config and vocab_map.pt (issue 11 item 3)."""

from pathlib import Path

import pytest
import torch
from test_decode import make_drafter, make_verifier

from eagle3.config import load_config
from eagle3.data.vocab import save_vocab_map
from eagle3.decoding.checks import check_drafter_vocab
from eagle3.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
TARGETS = list(range(0, 256, 8))  # draft vocab of 32 target ids


def _cfg(tmp_path, draft_vocab_size):
    return load_config(
        ROOT / "configs" / "tiny-llama.yaml",
        [f"output_root={tmp_path}", f"data.draft_vocab_size={draft_vocab_size}"],
    )


def test_own_export_with_other_draft_vocab_size_refused(tmp_path):
    drafter = make_drafter(make_verifier(), TARGETS)
    cfg = _cfg(tmp_path, 64)
    with pytest.raises(UserError) as e:
        check_drafter_vocab(
            drafter, cfg.export_dir, cfg.data.draft_vocab_size, cfg.data_dir, own_export=True
        )
    # the fix named is one that works: a plain 04 re-run into the same train folder is refused (fresh-user trial)
    assert str(e.value) == (
        f"{cfg.export_dir}: drafter has draft_vocab_size 32 but the config's "
        "data.draft_vocab_size is 64 (set data.draft_vocab_size back to 32, or train a drafter for "
        "it with 04_train.py into a new train.output_dir, or pass --drafter to benchmark another "
        "drafter)"
    )
    # a drafter from elsewhere (--drafter): warned, not refused
    (w,) = check_drafter_vocab(
        drafter, tmp_path / "other", cfg.data.draft_vocab_size, cfg.data_dir, own_export=False
    )
    assert "data.draft_vocab_size is 64" in w


def test_own_export_stale_against_vocab_map_refused(tmp_path):
    drafter = make_drafter(make_verifier(), TARGETS)
    cfg = _cfg(tmp_path, 32)
    assert (
        check_drafter_vocab(
            drafter, cfg.export_dir, cfg.data.draft_vocab_size, cfg.data_dir, own_export=True
        )
        == []
    )  # no vocab_map.pt yet
    ids = torch.tensor(TARGETS)  # [32]
    t2d = torch.zeros(256, dtype=torch.bool)
    t2d[ids] = True
    save_vocab_map(cfg.data_dir / "vocab_map.pt", ids - torch.arange(32), t2d)
    assert (
        check_drafter_vocab(
            drafter, cfg.export_dir, cfg.data.draft_vocab_size, cfg.data_dir, own_export=True
        )
        == []
    )  # same map
    other = torch.tensor([t + 1 for t in TARGETS])  # another stage-03 run's map, same size
    t2d2 = torch.zeros(256, dtype=torch.bool)
    t2d2[other] = True
    save_vocab_map(cfg.data_dir / "vocab_map.pt", other - torch.arange(32), t2d2)
    with pytest.raises(UserError, match=r"d2t differs from .*vocab_map.pt") as e:
        check_drafter_vocab(
            drafter, cfg.export_dir, cfg.data.draft_vocab_size, cfg.data_dir, own_export=True
        )
    assert str(e.value).endswith(
        "(re-run 03_prepare_data.py with the data settings the drafter was trained under, "
        "or train a drafter for it with 04_train.py into a new train.output_dir, or pass "
        "--drafter to benchmark another drafter)"
    )


def test_drafter_shape_against_the_config(tmp_path):
    """05 scores the export whatever the config's drafter: section says (fresh-user trial 2026-12-04e:
    `--set drafter.num_layers=3` at 05 benchmarked the 2-layer export silently). The run's own export is refused when
    they differ, naming the field; another run's export (--drafter) is a warning; null fields are not compared."""
    from eagle3.decoding.checks import check_drafter_shape

    drafter = make_drafter(make_verifier(), TARGETS)
    a = drafter.args
    same = [
        f"output_root={tmp_path}",
        f"drafter.num_attention_heads={a.num_attention_heads}",
        f"drafter.num_key_value_heads={a.num_key_value_heads}",
        f"drafter.head_dim={a.head_dim}",
        f"drafter.intermediate_size={a.intermediate_size}",
    ]

    def cfg(*extra):
        return load_config(ROOT / "configs" / "tiny-llama.yaml", [*same, *extra])

    assert check_drafter_shape(cfg().drafter, drafter, cfg().export_dir, own_export=True) == []
    deep = cfg("drafter.num_layers=2")
    with pytest.raises(
        UserError,
        match=r"the drafter has num_layers 1 but the config's drafter.num_layers is 2 "
        r"\(set those drafter fields back to the trained values, or train a drafter of "
        r"this shape with 04_train.py into a new train.output_dir, or pass --drafter",
    ):
        check_drafter_shape(deep.drafter, drafter, deep.export_dir, own_export=True)
    (w,) = check_drafter_shape(
        cfg(f"drafter.intermediate_size={a.intermediate_size + 8}").drafter,
        drafter,
        tmp_path / "other",
        own_export=False,
    )
    assert (
        f"intermediate_size {a.intermediate_size} but the config's drafter.intermediate_size is {a.intermediate_size + 8}"
        in w
    )
    ctx = cfg("drafter.max_position_embeddings=7")
    assert (
        check_drafter_shape(ctx.drafter, drafter, ctx.export_dir, own_export=True) == []
    )  # a re-export may change it alone
    loose = load_config(
        ROOT / "configs" / "tiny-llama.yaml",
        [
            f"output_root={tmp_path}",
            "drafter.num_attention_heads=null",
            "drafter.num_key_value_heads=null",
            "drafter.head_dim=null",
            "drafter.intermediate_size=null",
        ],
    )
    assert (
        check_drafter_shape(loose.drafter, drafter, loose.export_dir, own_export=True) == []
    )  # nulls: the verifier's
