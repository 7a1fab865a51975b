"""Online training (``train.hidden_states: online``): 02 writes token-only samples, 04 runs the verifier.

On a tiny random fp32 Llama verifier (CPU): 02 offline (hidden-state shards, every sample captured alone:
``extract.batch_tokens: 1``) and 02 online (token-only) over the same prompts, 03 over each, then 04:

- token-only samples hold the same ids, masks and manifest rows; 03 gives the same vocab map and split;
- online == offline bitwise (losses of every step, the first step's gradient, final weights) for batch 1
  x accumulation 2 (every verifier forward in 04 is then the forward 02 ran);
- with padded batches (batch 2) online == offline up to fp32 rounding (02 captured each sample alone, 04
  a padded pair), and the online states of a padded batch are zero at the padding;
- an online run SIGKILLed at random points and resumed ends with the uninterrupted run's weights;
- 2 gloo ranks online == 1 process offline on the same global batch.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

HERE = Path(__file__).resolve().parent

from _ddp_worker import single_thread  # noqa: E402,F401  (autouse fixture)
from _paths import child_env
from test_extract import _write_prompts  # noqa: E402
from test_fault_train import (
    _start,  # noqa: E402  (04 as a subprocess, the in-process reference's env)
    _wait_progress,  # noqa: E402
)
from test_fault_train import _train_steps as _steps  # noqa: E402

from eagle3.config import load_config  # noqa: E402
from eagle3.stages import prepare_data  # noqa: E402
from eagle3.train import checkpoint as ckpt  # noqa: E402

ROOT = HERE.parents[1]
AUX = [1, 3, 4]
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron".split()
CONVS = [
    (
        f"q{i}",
        [
            ("user", f"Question {i}: list {i % 5 + 1} words."),
            (
                "assistant",
                "Sure: " + " ".join(WORDS[(i + k) % len(WORDS)] for k in range(2 + (5 * i) % 9)),
            ),
        ],
    )
    for i in range(10)
]
TRAIN = {
    "ttt_length": 2,
    "lr": 3e-3,
    "warmup_ratio": 0.25,
    "epochs": 2,
    "batch_size": 1,
    "grad_accum": 2,
    "log_every": 1,
    "ckpt_every": 2,
    "keep_checkpoints": 2,
    "eval_every": 100,
    "seed": 0,
}


def _yaml(
    root: Path,
    tiny: Path,
    online: bool,
    train: dict | None = None,
    shards: Path | None = None,
    data: Path | None = None,
) -> Path:
    """A run YAML under ``root`` (``output_root``); ``shards``/``data``: read another run's 02/03 outputs."""
    cfg = {
        "run_name": "online-test",
        "output_root": str(root),
        "verifier": {"path": str(tiny), "name": "tiny-llama", "dtype": "float32", "device": "cpu"},
        "prompts": {"source": "humaneval"},
        "extract": {
            "aux_layers": AUX,
            "max_length": 64,
            "batch_tokens": 1,
            "rows_per_dir": 4,
            "disk_margin_bytes": 0,
            **({"output_dir": str(shards)} if shards else {}),
        },
        "data": {
            "draft_vocab_size": 64,
            "val_fraction": 0.2,
            **({"output_dir": str(data)} if data else {}),
        },
        "drafter": {
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "intermediate_size": 64,
        },
        "train": {**TRAIN, **(train or {}), "hidden_states": "online" if online else "offline"},
        "export": {"dtype": "float32"},
    }
    root.mkdir(parents=True, exist_ok=True)
    path = root / ("online.yaml" if online else "offline.yaml")
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, tiny_llama_dir) -> dict:
    """02 + 03 offline (hidden states) and online (token-only) over the same prompts."""
    from eagle3.stages import extract, prepare_data

    out = {}
    for kind in ("offline", "online"):
        root = tmp_path_factory.mktemp(kind)
        _write_prompts(root / "prompts.jsonl", CONVS)
        cfg = load_config(_yaml(root, tiny_llama_dir, kind == "online"))
        out[kind] = {
            "root": root,
            "extract": extract.run(cfg),
            "data": prepare_data.run(cfg, plot=False),
            "cfg": cfg,
        }
    return out


def _train_cfg(prepared: dict, name: str, tiny: Path, online: bool, tmp: Path, **train):
    """A config training on ``prepared[name]``'s 02/03 outputs with its own train/export folders under ``tmp``."""
    src = prepared[name]["cfg"]
    path = _yaml(tmp, tiny, online, train, shards=src.shards_dir, data=src.data_dir)
    return path, load_config(path)


def _rows(train_dir: Path, kind: str = "train") -> list[dict]:
    return [
        r
        for r in (json.loads(x) for x in (train_dir / "metrics.jsonl").read_text().splitlines())
        if r["kind"] == kind
    ]


def _final(train_dir: Path) -> dict:
    return ckpt.load_checkpoint(ckpt.list_checkpoints(train_dir)[-1][1])


def _first_grads(train_dir: Path) -> list[torch.Tensor]:
    """The first step's gradient: AdamW's first moment after one step is exactly ``(1 - beta1) * grad``."""
    opt = ckpt.load_checkpoint(dict(ckpt.list_checkpoints(train_dir))[1])["optimizer"]
    return [opt["state"][i]["exp_avg"] / 0.1 for i in sorted(opt["state"])]


def test_token_only_samples_and_their_03(prepared):
    from eagle3.shards.data_config import read_data_config
    from eagle3.shards.format import list_samples
    from eagle3.shards.read import load_sample

    off, on = prepared["offline"], prepared["online"]
    meta_on, meta_off = (
        read_data_config(on["cfg"].shards_dir),
        read_data_config(off["cfg"].shards_dir),
    )
    assert meta_on["format"] == "eagle3-tokens-v1" and meta_on["bytes_per_token"] == 0
    assert meta_on["dtype"] == meta_on["storage_dtype"] == "none"
    for key in (
        "aux_layers",
        "hidden_size",
        "vocab_size",
        "num_layers",
        "last_hidden_state",
        "architecture",
        "num_samples",
        "num_tokens",
        "num_loss_tokens",
        "skipped",
    ):
        assert meta_on[key] == meta_off[key], key
    a, b = list_samples(on["cfg"].shards_dir), list_samples(off["cfg"].shards_dir)
    assert [i for i, _ in a] == [i for i, _ in b] and len(a) == 10
    plan = on["extract"]["disk_plan"]
    assert plan["hidden_bytes_per_token"] == 0 and plan["file_bytes_per_token"] == 16.0
    for (_, pa), (_, pb) in zip(a, b):
        raw = torch.load(pa, weights_only=True)
        assert sorted(raw) == ["input_ids", "loss_mask"]  # no hidden states on disk
        sb = load_sample(pb)
        assert torch.equal(raw["input_ids"], sb["input_ids"]) and torch.equal(
            raw["loss_mask"], sb["loss_mask"]
        )
        L = raw["input_ids"].numel()
        # the disk plan's size model of token-only shards (16 bytes/token + torch.save's per-file bytes)
        assert abs(pa.stat().st_size - (plan["file_overhead_bytes"] + 16 * L)) <= 2 * 64
    assert on["extract"]["disk_gb"] == round(meta_on["num_tokens"] * 16 / 1e9, 4)
    # 03: the same token frequencies, vocab map and split from token-only samples
    for f in ("token_freq.pt", "vocab_map.pt", "split.json"):
        assert (on["cfg"].data_dir / f).read_bytes() == (off["cfg"].data_dir / f).read_bytes(), f
    assert on["data"]["validation"] == "full" and on["data"]["storage_dtype"] == "none"


def test_offline_training_refuses_token_only_samples(prepared, tiny_llama_dir, tmp_path):
    from eagle3.errors import UserError
    from eagle3.stages.train import run

    _path, cfg = _train_cfg(prepared, "online", tiny_llama_dir, False, tmp_path)
    with pytest.raises(UserError, match="eagle3-tokens-v1.*train.hidden_states: online"):
        run(cfg, device="cpu")


@pytest.mark.parametrize("kind", ["offline", "online"])
def test_verifier_path_to_other_weights_under_the_same_name_is_refused(
    prepared, tiny_llama_dir, tmp_path, kind
):
    """verifier.path pointed at another model of the same shapes under the shards' verifier.name: 04 offline trained
    without an error against the other model's lm_head (val top-1 0.000, exit 0) and online against the other model's
    states (fresh-user trial 2026-12-05f). 02 now records the weight files' fingerprint and 03/04 refuse other weights
    in one line; a moved copy of the same model passes."""
    import shutil

    from safetensors.torch import load_file, save_file

    from eagle3.errors import UserError
    from eagle3.shards.checks import check_verifier
    from eagle3.shards.data_config import read_data_config
    from eagle3.stages.train import run
    from eagle3.verifier.load import weights_fingerprint

    src = prepared[kind]["cfg"]
    meta = read_data_config(src.shards_dir)
    assert meta["verifier_weights"] == weights_fingerprint(src.verifier)
    assert meta["verifier_weights"].startswith("sha256:")
    moved, other = tmp_path / "moved", tmp_path / "other"
    shutil.copytree(tiny_llama_dir, moved)
    shutil.copytree(tiny_llama_dir, other)
    w = load_file(other / "model.safetensors")
    save_file(
        {k: (v + 0.01 if v.is_floating_point() else v) for k, v in w.items()},
        other / "model.safetensors",
        metadata={"format": "pt"},
    )
    _p, cfg = _train_cfg(prepared, kind, moved, kind == "online", tmp_path / "a")
    check_verifier(cfg.verifier, meta, cfg.shards_dir)  # the same bytes elsewhere: the same model
    for absent in (
        tmp_path / "nowhere",
        "package:no_such_package_here",
    ):  # nothing to compare on this machine
        assert weights_fingerprint(cfg.verifier.model_copy(update={"path": str(absent)})) is None
    _p, cfg = _train_cfg(prepared, kind, other, kind == "online", tmp_path / "b")
    want = (
        f"{cfg.shards_dir / 'data_config.json'}: the weights at verifier.path {meta['verifier_weights']!r} -> "
        f"{weights_fingerprint(cfg.verifier)!r}; re-run 02_extract_hidden.py"
    )
    with pytest.raises(UserError) as e:
        run(cfg, device="cpu")
    assert str(e.value) == want and not cfg.train_dir.exists()
    with pytest.raises(UserError) as e:
        prepare_data.run(cfg, plot=False)
    assert str(e.value) == want
    # the export records the fingerprint; 05 warns when verifier.path holds other weights (as for another name)
    from eagle3.decoding.checks import verifier_check
    from eagle3.stages.export import export_for_run
    from eagle3.verifier.load import load_verifier_config, verifier_dims

    _p, cfg = _train_cfg(prepared, kind, moved, kind == "online", tmp_path / "c", max_steps=1)
    run(cfg, device="cpu", export=export_for_run)
    rec = json.loads((cfg.export_dir / "eagle3_train.json").read_text())["verifier"]
    assert rec["weights"] == meta["verifier_weights"]
    dims = verifier_dims(load_verifier_config(cfg.verifier))
    assert verifier_check(
        cfg.export_dir, "tiny-llama", dims, weights_fingerprint(cfg.verifier)
    ) == (None, None)
    other_fp = weights_fingerprint(cfg.verifier.model_copy(update={"path": str(other)}))
    assert verifier_check(cfg.export_dir, "tiny-llama", dims, other_fp)[0] == (
        f"drafter {cfg.export_dir / 'eagle3_train.json'} was exported for verifier 'tiny-llama' with other weights "
        f"than the model at verifier.path (key 'verifier.weights': {meta['verifier_weights'][:19]}... recorded, "
        f"{other_fp[:19]}... at verifier.path): tau measures the drafter against another model"
    )


def test_online_from_servers_without_urls_is_refused_before_the_head_is_extracted(
    prepared, tiny_llama_dir, tmp_path, caplog
):
    """train.hidden_states: online with extract.backend: sglang and no extract.sglang_url: the one-line refusal came
    after 04 had extracted the verifier's embedding / lm_head / norm (minutes for Kimi-K2.5's 2 x 2.3 GB; fresh-user
    trial 2026-12-05f); it now comes with the other config checks, before anything is read or written."""
    import logging

    from eagle3.errors import UserError
    from eagle3.stages.train import run

    _p, cfg = _train_cfg(prepared, "online", tiny_llama_dir, True, tmp_path)
    cfg = cfg.model_copy(update={"extract": cfg.extract.model_copy(update={"backend": "sglang"})})
    with (
        caplog.at_level(logging.INFO, logger="eagle3.train"),
        pytest.raises(UserError) as e,
    ):
        run(cfg, device="cpu")
    assert str(e.value) == (
        "extract.sglang_url / extract.capture_dir: required for train.hidden_states: online with "
        "extract.backend: sglang (the capture servers 04 trains from)"
    )
    assert not [
        r for r in caplog.records if "extracting the verifier's embedding" in r.getMessage()
    ]
    assert not cfg.train_dir.exists()


def test_online_over_shards_with_states_says_they_are_not_read(
    prepared, tiny_llama_dir, tmp_path, caplog
):
    """train.hidden_states: online over shards 02 wrote offline (hidden states inside) recomputed every state with the
    verifier without a word. One info line now says the shards' states are not read, why, and the key that reads them;
    over token-only samples there is nothing to say."""
    import logging

    from eagle3.stages.train import run

    _p, on = _train_cfg(prepared, "offline", tiny_llama_dir, True, tmp_path / "full", max_steps=1)
    with caplog.at_level(logging.INFO, logger="eagle3.train"):
        assert run(on, device="cpu")["hidden_states"] == "online"
    lines = [r.getMessage() for r in caplog.records if "they are not read" in r.getMessage()]
    assert lines == [
        f"train.hidden_states: online: {on.shards_dir} holds the verifier's hidden states too (format "
        f"'speculators-v1', 02 ran offline); they are not read: online computes each micro-batch's states "
        f"with the verifier (extract.backend hf), as asked; set train.hidden_states: offline to train "
        f"from the shards without running the verifier"
    ]
    caplog.clear()
    _p, tok = _train_cfg(prepared, "online", tiny_llama_dir, True, tmp_path / "tokens", max_steps=1)
    with caplog.at_level(logging.INFO, logger="eagle3.train"):
        run(tok, device="cpu")
    assert "they are not read" not in caplog.text


def test_online_equals_offline_bitwise(prepared, tiny_llama_dir, tmp_path):
    from eagle3.stages.train import run

    keep = {
        "ckpt_every": 1,
        "keep_checkpoints": 20,
    }  # the step-1 checkpoint holds the first gradient
    _p, off = _train_cfg(prepared, "offline", tiny_llama_dir, False, tmp_path / "off", **keep)
    _p, on = _train_cfg(prepared, "online", tiny_llama_dir, True, tmp_path / "on", **keep)
    r_off, r_on = run(off, device="cpu"), run(on, device="cpu")
    assert r_off["step"] == r_on["step"] == 8  # 8 train samples / (1 x 2) per step x 2 epochs
    assert r_on["hidden_states"] == "online"
    lo, ln = _rows(off.train_dir), _rows(on.train_dir)
    assert [r["loss"] for r in lo] == [r["loss"] for r in ln] and len(lo) == 8
    assert [r["grad_norm"] for r in lo] == [r["grad_norm"] for r in ln]
    assert _rows(off.train_dir, "val")[-1] == _rows(on.train_dir, "val")[-1]
    grads = list(zip(_first_grads(off.train_dir), _first_grads(on.train_dir)))
    assert grads and all(torch.equal(ga, gb) for ga, gb in grads)
    assert any(float(ga.abs().max()) > 0 for ga, _ in grads)
    a, b = _final(off.train_dir)["model"], _final(on.train_dir)["model"]
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert lo[0]["loss"] != lo[-1]["loss"]  # it trained


def test_online_padded_batches_close_to_offline(prepared, tiny_llama_dir, tmp_path):
    from eagle3.stages.train import run

    train = {"batch_size": 2, "grad_accum": 1, "epochs": 1}
    _p, off = _train_cfg(prepared, "offline", tiny_llama_dir, False, tmp_path / "off", **train)
    _p, on = _train_cfg(prepared, "online", tiny_llama_dir, True, tmp_path / "on", **train)
    run(off, device="cpu")
    run(on, device="cpu")
    lo, ln = [r["loss"] for r in _rows(off.train_dir)], [r["loss"] for r in _rows(on.train_dir)]
    assert len(lo) == len(ln) == 4
    torch.testing.assert_close(torch.tensor(ln), torch.tensor(lo), rtol=1e-4, atol=0)
    a, b = _final(off.train_dir)["model"], _final(on.train_dir)["model"]
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-3, atol=1e-5, msg=k)


def test_online_states_of_a_padded_batch(prepared, tiny_llama_dir):
    """VerifierStates.fill == 02's capture of each sample (bf16), zero at the padding; the verifier is frozen."""
    from eagle3.data.dataset import collate
    from eagle3.shards.format import list_samples
    from eagle3.shards.read import load_sample
    from eagle3.train.online import VerifierStates

    on, off = prepared["online"], prepared["offline"]
    meta = json.loads((on["cfg"].shards_dir / "data_config.json").read_text())
    src = VerifierStates.load(on["cfg"].verifier, meta, torch.device("cpu"), torch.float32)
    assert (
        not any(p.requires_grad for p in src.capture.model.parameters())
        and not src.capture.model.training
    )
    samples = [load_sample(p) for _, p in list_samples(off["cfg"].shards_dir)[:3]]
    items = [{"input_ids": s["input_ids"], "loss_mask": s["loss_mask"]} for s in samples]
    batch = collate(items)
    assert not {"aux", "last"} & set(batch)
    got = src.fill(batch)
    assert got["aux"].dtype == torch.float32 and got["aux"].shape[-1] == 3 * meta["hidden_size"]
    assert got["aux"].grad_fn is None and not got["aux"].requires_grad
    for b, s in enumerate(samples):
        n = s["input_ids"].numel()
        want_aux = torch.cat(s["hidden_states"][:3], dim=-1).float()  # [n, 3H] 02's bf16 states
        torch.testing.assert_close(got["aux"][b, :n], want_aux, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(
            got["last"][b, :n], s["hidden_states"][3].float(), rtol=2e-2, atol=2e-2
        )
        assert not got["aux"][b, n:].any() and not got["last"][b, n:].any()
    # a batch of one: the very forward 02 ran, bit for bit
    one = src.fill(collate(items[:1]))
    assert torch.equal(one["aux"][0], torch.cat(samples[0]["hidden_states"][:3], dim=-1).float())
    assert torch.equal(one["last"][0], samples[0]["hidden_states"][3].float())


def test_online_verifier_mismatch_is_user_error(prepared, tiny_llama_dir):
    from eagle3.errors import UserError
    from eagle3.train.online import VerifierStates

    meta = json.loads((prepared["online"]["cfg"].shards_dir / "data_config.json").read_text())
    with pytest.raises(UserError, match="key 'last_hidden_state' is 'pre_norm'"):
        VerifierStates.load(
            prepared["online"]["cfg"].verifier,
            {**meta, "last_hidden_state": "pre_norm"},
            torch.device("cpu"),
            torch.float32,
        )


# ---- resume after SIGKILL ------------------------------------------------------------------------
KILL_TRAIN = {"batch_size": 1, "grad_accum": 1, "epochs": 2, "ckpt_every": 3}  # 16 steps
TOTAL = 16


@pytest.mark.slow
def test_online_sigkill_then_resume_matches_uninterrupted(prepared, tiny_llama_dir, tmp_path):
    from eagle3.stages.train import run

    _p, ref = _train_cfg(prepared, "online", tiny_llama_dir, True, tmp_path / "ref", **KILL_TRAIN)
    run(ref, device="cpu")
    want = _final(ref.train_dir)["model"]
    cfg_path, cfg = _train_cfg(
        prepared, "online", tiny_llama_dir, True, tmp_path / "killed", **KILL_TRAIN
    )
    rng = random.Random(20261202)
    kills = 0
    for _attempt in range(3):
        before = (_steps(cfg.train_dir) or [0])[-1]
        proc = _start(cfg_path, "--resume")
        if _wait_progress(proc, cfg.train_dir, before):
            time.sleep(
                rng.uniform(0.0, 0.5)
            )  # somewhere in a step (verifier forward included) or a write
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                kills += 1
        proc.communicate(timeout=60)
    assert kills >= 2, "the kills should land while training runs"
    proc = _start(cfg_path, "--resume")
    _out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-2000:]
    got = _final(cfg.train_dir)
    assert got["step"] == TOTAL
    assert all(torch.equal(got["model"][k], v) for k, v in want.items())
    assert _steps(cfg.train_dir) == list(range(1, TOTAL + 1))


# ---- DDP ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_online_two_gloo_ranks_match_offline_one_process(prepared, tiny_llama_dir, tmp_path):
    from eagle3.stages.train import run

    # global batch 4 per optimizer step: 1 process x (2 samples x 2 accum) vs 2 ranks x (1 sample x 2 accum)
    _p, one = _train_cfg(
        prepared, "offline", tiny_llama_dir, False, tmp_path / "one", batch_size=2, grad_accum=2
    )
    two_yaml, two = _train_cfg(
        prepared, "online", tiny_llama_dir, True, tmp_path / "two", batch_size=1, grad_accum=2
    )
    assert run(one, device="cpu")["step"] == 4
    env = child_env(ROOT)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(ROOT / "tests" / "_ddp_worker.py"),
        "--config",
        str(two_yaml),
    ]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    s1, s2 = _final(one.train_dir), _final(two.train_dir)
    assert s1["step"] == s2["step"] == 4 and s2["world_size"] == 2
    torch.testing.assert_close(
        torch.tensor([r["loss"] for r in _rows(two.train_dir)]),
        torch.tensor([r["loss"] for r in _rows(one.train_dir)]),
        rtol=1e-5,
        atol=0,
    )
    for k, v in s1["model"].items():
        torch.testing.assert_close(s2["model"][k], v, atol=1e-5, rtol=1e-5, msg=k)


def test_online_nonfinite_verifier_states_stop_the_run(
    prepared, tiny_llama_dir, tmp_path, monkeypatch
):
    """A verifier that overflows on some micro-batch (here: NaN injected into its 3rd prefill) stops 04 at the next
    log step with one UserError naming verifier.dtype; no checkpoint is written after it."""
    from eagle3.capture.hf import HFCapture
    from eagle3.errors import UserError
    from eagle3.stages.train import run

    real = HFCapture.prefill_states
    calls = []

    def overflowing(self, ids, attention_mask=None):
        states = real(self, ids, attention_mask)
        calls.append(1)
        if len(calls) == 3:  # micro-batch 1 of optimizer step 2
            states[1] = states[1].clone()
            states[1][0, 0, 0] = float("nan")
        return states

    monkeypatch.setattr(HFCapture, "prefill_states", overflowing)
    _p, cfg = _train_cfg(
        prepared, "online", tiny_llama_dir, True, tmp_path, ckpt_every=1, keep_checkpoints=20
    )
    with pytest.raises(
        UserError,
        match=r"NaN/Inf in a micro-batch up to optimizer step 2 with verifier.dtype float32",
    ):
        run(cfg, device="cpu")
    assert [s for s, _ in ckpt.list_checkpoints(cfg.train_dir)] == [1]
    assert [r["step"] for r in _rows(cfg.train_dir)] == [1]


def test_a_run_resumed_in_the_other_mode_reports_each_part(
    prepared, tiny_llama_dir, tmp_path, caplog
):
    """A checkpoint trained offline and resumed online (train.hidden_states) reported only the last mode in
    train_report.json. Each 04 call's part is recorded now (checkpoint and report key ``segments``: steps, state source,
    processes, tokens/s), train_report.md lists them, and the switch is warned about in one line (logged and in the
    report's warnings); a resume in the same mode warns about nothing."""
    import logging

    from eagle3.stages.train import run

    _p, off = _train_cfg(
        prepared, "offline", tiny_llama_dir, False, tmp_path / "run", max_steps=100
    )
    _p, on = _train_cfg(prepared, "offline", tiny_llama_dir, True, tmp_path / "run", max_steps=100)
    assert off.train_dir == on.train_dir
    assert run(off, stop_after=3, device="cpu")["step"] == 3
    first = json.loads((off.train_dir / "train_report.json").read_text())["warnings"]
    assert [
        w for w in first if w.startswith("train.max_steps 100 is more than the 8 optimizer steps")
    ]
    with caplog.at_level(logging.WARNING):
        res = run(on, resume=True, device="cpu")
    assert res["step"] == 8 and res["hidden_states"] == "online"
    want = (
        f"{ckpt.ckpt_path(on.train_dir, 3)}: steps 0-3 were trained with train.hidden_states offline, this call "
        f"trains with online (extract.backend hf) from step 3; the states are the same verifier's up to the shards' "
        f"storage rounding (bf16 / fp8) and the capture dtype; train_report.json 'segments' lists each part"
    )
    assert caplog.messages.count(want) == 1
    rep = json.loads((on.train_dir / "train_report.json").read_text())
    assert want in rep["warnings"]
    segs = rep["segments"]
    assert [
        (g["start_step"], g["end_step"], g["hidden_states"], g["extract_backend"], g["world_size"])
        for g in segs
    ] == [(0, 3, "offline", None, 1), (3, 8, "online", "hf", 1)]
    assert all(g["tokens_per_s"] > 0 for g in segs)
    assert (
        segs[0]["warnings"] == first and want in segs[1]["warnings"]
    )  # each call's own warning lines
    assert _final(on.train_dir)["segments"] == segs  # the last checkpoint carries the history on
    md = (on.train_dir / "train_report.md").read_text()
    assert (
        f"- trained in parts: steps 0-3 offline, 1 process, {segs[0]['tokens_per_s']:.0f} tokens/s; steps 3-8 "
        f"online (hf), 1 process, {segs[1]['tokens_per_s']:.0f} tokens/s\n"
    ) in md
    assert "tokens/s (all ranks; this call's, steps 3-8)" in md
    assert all(
        f"- **warning** (steps 0-3): {w}\n" in md for w in first
    )  # the first call's: its report alone had them
    # a fresh run in one call: one part, nothing said about parts
    _p, one = _train_cfg(prepared, "offline", tiny_llama_dir, False, tmp_path / "one", max_steps=2)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        r1 = run(one, stop_after=1, device="cpu")
        r2 = run(one, resume=True, device="cpu")
    assert (r1["step"], r2["step"]) == (1, 2) and "train.hidden_states" not in caplog.text
    rep = json.loads((one.train_dir / "train_report.json").read_text())
    assert [(g["start_step"], g["end_step"], g["hidden_states"]) for g in rep["segments"]] == [
        (0, 1, "offline"),
        (1, 2, "offline"),
    ]


def test_segments_of_a_checkpoint_from_before_the_record():
    """A checkpoint without ``segments`` (before 2026-12-05h) is one part, steps 0 to its step, mode not recorded (no
    switch is claimed); recorded parts are cut at the checkpoint's step."""
    from eagle3.train.report import earlier_segments, segment_record, state_source_switch

    old = earlier_segments({"step": 40, "world_size": 8})
    assert old == [segment_record(0, 40, None, None, 8, None)] and old[0]["hidden_states"] is None
    assert old[0]["warnings"] == []
    now = segment_record(40, 40, "online", "sglang", 8, None)
    assert state_source_switch(Path("c.pt"), old, now) is None
    rec = [
        segment_record(0, 20, "offline", "hf", 1, 10.0),
        segment_record(20, 50, "online", "sglang", 1, 5.0),
    ]
    assert rec[0]["extract_backend"] is None  # offline: no backend recorded
    got = earlier_segments({"step": 40, "world_size": 1, "segments": rec})
    assert [(g["start_step"], g["end_step"]) for g in got] == [(0, 20), (20, 40)]
    assert (
        state_source_switch(Path("c.pt"), got, segment_record(40, 40, "online", "sglang", 1, None))
        is None
    )
    assert state_source_switch(
        Path("c.pt"), got, segment_record(40, 40, "online", "hf", 1, None)
    ).startswith(
        "c.pt: steps 20-40 were trained with train.hidden_states online (extract.backend sglang), this call trains with "
        "online (extract.backend hf) from step 40"
    )


@pytest.mark.slow
def test_online_under_torchrun_says_each_replica_line_once(prepared, tiny_llama_dir, tmp_path):
    """``torchrun --nproc_per_node 2 04_train.py`` with ``train.hidden_states: online``: every rank loads its verifier
    replica and probes its last hidden state, and each logged `online hidden states: ...` and `verifier
    hidden_states[-1] is post_norm`, two copies of each in the job's log. Rank 0 now says them, once."""
    two_yaml, two = _train_cfg(
        prepared, "online", tiny_llama_dir, True, tmp_path / "two", batch_size=1, grad_accum=2
    )
    env = child_env(ROOT)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(ROOT / "04_train.py"),
        "--config",
        str(two_yaml),
    ]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    out = (p.stdout + p.stderr).splitlines()
    for marker in (
        "INFO eagle3.train.online: online hidden states: ",
        "verifier hidden_states[-1] is post_norm",
    ):
        assert len([ln for ln in out if marker in ln]) == 1, (marker, p.stderr[-3000:])
