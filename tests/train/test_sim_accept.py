"""Best checkpoint by simulated acceptance (``train.select_best: sim_accept``): tau_sim against hand
values, the tracker's best / restore / resume rules, and tiny training runs that export the best
validation's weights (or the last ones), report the curve (JSON + PNG + Markdown), and train an
EAGLE-3.1 drafter end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _ddp_worker import make_tiny_run, single_thread  # noqa: F401  (autouse fixture)
from safetensors.torch import load_file

from eagle3.config import load_config
from eagle3.errors import UserError
from eagle3.export.reader import load_exported
from eagle3.io.read import safe_torch_load
from eagle3.stages.export import export_for_run, export_from_checkpoint
from eagle3.stages.train import run
from eagle3.train import checkpoint as ckpt
from eagle3.train.sim_accept import (
    BEST_FILE,
    CURVE_FILE,
    PLOT_FILE,
    BestTracker,
    markdown_lines,
    position_acceptance,
    simulated_tau,
)


def test_simulated_tau_hand_values():
    a = [0.8, 0.5, 0.25, 0.5]
    assert simulated_tau(a, 1) == pytest.approx(1.8)
    assert simulated_tau(a, 3) == pytest.approx(1 + 0.8 + 0.4 + 0.1)  # 2.3
    assert simulated_tau(a, 4) == pytest.approx(2.35)
    assert simulated_tau(a, 7) == pytest.approx(2.35)  # only K positions are known
    # TorchSpec / SpecForge simulated_acc_len over every TTT position = tau_sim(K) - 1
    cum, ts = 1.0, 0.0
    for x in a:
        cum *= x
        ts += cum
    assert simulated_tau(a, len(a)) - 1 == pytest.approx(ts)
    assert simulated_tau([1.0] * 3, 3) == 4.0 and simulated_tau([0.0, 1.0], 2) == 1.0
    with pytest.raises(ValueError):
        simulated_tau([1.2], 1)
    with pytest.raises(ValueError):
        simulated_tau([0.5], 0)
    assert position_acceptance({"acc_0": 0.5, "acc_1": 0.25, "loss": 1.0, "acc_3": 0.9}) == [
        0.5,
        0.25,
    ]


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(3))
        self.frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)


def _val(*acc):
    return {"loss": 1.0, **{f"acc_{i}": a for i, a in enumerate(acc)}}


def test_tracker_keeps_best_weights_and_restores_them(tmp_path):
    m = _Tiny()
    tr = BestTracker(tmp_path, chain=2, enabled=True, keep_best=True)
    with torch.no_grad():
        m.w.fill_(1.0)
    assert tr.update(10, 0, _val(0.5, 0.5, 0.1), m)  # tau 1.75
    with torch.no_grad():
        m.w.fill_(2.0)
    assert tr.update(20, 1, _val(0.8, 0.5, 0.0), m)  # tau 2.2: new best
    with torch.no_grad():
        m.w.fill_(3.0)
    assert not tr.update(30, 2, _val(0.6, 0.9, 0.9), m)  # tau 2.14: not better at chain 2
    assert not tr.update(40, 2, _val(0.8, 0.5, 0.9), m)  # a tie keeps the earlier one
    curve = json.loads((tmp_path / CURVE_FILE).read_text())
    assert [r["step"] for r in curve["rows"]] == [10, 20, 30, 40] and curve["best"]["step"] == 20
    assert curve["rows"][1]["tau_sim"] == pytest.approx(2.2)
    assert curve["rows"][2]["tau_sim_all"]["3"] == pytest.approx(1 + 0.6 + 0.54 + 0.486)
    assert tr.restore_best(m) == 20 and torch.equal(m.w.detach(), torch.full((3,), 2.0))
    assert set(safe_torch_load(tmp_path / BEST_FILE)["model"]) == {"w"}  # trainable tensors only
    tr.plot()
    assert (tmp_path / PLOT_FILE).stat().st_size > 1000


def test_tracker_resume_drops_later_rows_but_keeps_a_later_best_with_its_weights(tmp_path):
    m = _Tiny()
    tr = BestTracker(tmp_path, chain=3, enabled=True, keep_best=True)
    tr.update(10, 0, _val(0.5, 0.5, 0.5), m)
    with torch.no_grad():
        m.w.fill_(7.0)
    tr.update(20, 1, _val(0.9, 0.9, 0.9), m)  # best, at step 20 (tau 3.439)
    # resumed from the step-20 checkpoint: everything kept
    r20 = BestTracker(tmp_path, chain=3, enabled=True, start_step=20, keep_best=True)
    assert (
        [r["step"] for r in r20.rows] == [10, 20]
        and r20.best["step"] == 20
        and "before_resume" not in r20.best
    )
    # resumed from step 15 (killed after the step-20 validation, before its checkpoint): the step-20 row is redone,
    # but the step-20 best stays with its weights until the resumed run beats it
    r15 = BestTracker(tmp_path, chain=3, enabled=True, start_step=15, keep_best=True)
    assert (
        [r["step"] for r in r15.rows] == [10]
        and r15.best["step"] == 20
        and r15.best["before_resume"] is True
    )
    assert r15.best["tau_sim"] == pytest.approx(1 + 0.9 + 0.81 + 0.729)
    with torch.no_grad():
        m.w.fill_(1.0)
    assert not r15.update(
        20, 1, _val(0.8, 0.8, 0.8), m
    )  # the rerun validated step 20 worse: the old best stays
    assert r15.restore_best(m) == 20 and torch.equal(m.w.detach(), torch.full((3,), 7.0))
    assert "Best: step 20 before the resume (tau_sim(3) 3.4390" in "\n".join(
        markdown_lines(r15.summary())
    )
    with torch.no_grad():
        m.w.fill_(1.0)
    assert r15.update(
        20, 1, _val(0.9, 0.9, 0.9), m
    )  # measured again as high: this run's weights replace it
    assert (
        "before_resume" not in r15.best
        and json.loads((tmp_path / CURVE_FILE).read_text())["best"]["step"] == 20
    )
    assert r15.restore_best(m) == 20 and torch.equal(m.w.detach(), torch.full((3,), 1.0))
    # select_best: last keeps no weights: a best after the checkpoint is dropped with its row
    last = BestTracker(tmp_path, chain=3, enabled=True, start_step=15, keep_best=False)
    assert [r["step"] for r in last.rows] == [10] and last.best["step"] == 10
    # a fresh run (step 0) starts the curve anew
    fresh = BestTracker(tmp_path, chain=3, enabled=True, start_step=0, keep_best=True)
    assert (
        fresh.rows == []
        and not (tmp_path / CURVE_FILE).exists()
        and not (tmp_path / BEST_FILE).exists()
    )


def test_a_resume_after_a_hard_kill_keeps_the_best_validation_of_the_killed_run(
    tmp_path, monkeypatch
):
    """SIGKILL after the step-3 validation (the best so far) and before the step-4 checkpoint: the resumed run starts
    at step 2, and a rerun that is not bit-deterministic may validate step 3 worse. Before, the resume dropped the
    step-3 best (and best_drafter.pt), so the export held a later, worse validation's weights than the killed run had
    reported; now the step-3 score, step and weights are kept until a validation beats them."""
    from eagle3.train.loop import TrainLoop

    cfg = load_config(
        make_tiny_run(
            tmp_path,
            n_train=8,
            n_val=4,
            train={
                "epochs": 3,
                "eval_every": 1,
                "ckpt_every": 2,
                "keep_checkpoints": 100,
                "select_best": "sim_accept",
                "lr": 5e-2,
            },
        )
    )
    run(cfg, stop_after=3, device="cpu")  # validates steps 1..3, checkpoints at 2 and 3
    before = json.loads((cfg.train_dir / CURVE_FILE).read_text())["best"]
    weights = safe_torch_load(cfg.train_dir / BEST_FILE)["model"]
    assert (
        before["step"] == 3
    )  # (this seed's best of steps 1..3, and of the whole run: the test needs it)
    (
        ckpt.ckpt_dir(cfg.train_dir) / "step_00000003.pt"
    ).unlink()  # the kill: no checkpoint after the validation
    real = TrainLoop.validate

    def rerun_validates_step_3_worse(
        self,
    ):  # a non-deterministic rerun (e.g. other GPU kernels) scoring lower
        val = real(self)
        return (
            {k: (v * 0.5 if k.startswith("acc_") else v) for k, v in val.items()}
            if self.pos.step == 3
            else val
        )

    monkeypatch.setattr(TrainLoop, "validate", rerun_validates_step_3_worse)
    r = run(cfg, resume=True, device="cpu", export=export_for_run)
    sa = r["sim_accept"]
    assert (
        max(row["tau_sim"] for row in sa["rows"]) < before["tau_sim"]
    )  # the resumed run never reaches it
    assert sa["best"]["step"] == sa["exported_step"] == 3 and sa["best"]["before_resume"] is True
    assert sa["best"]["tau_sim"] == pytest.approx(before["tau_sim"])
    exported = load_file(str(cfg.export_dir / "model.safetensors"))
    assert torch.equal(exported["fc.weight"], weights["fc.weight"].bfloat16())
    assert "Best: step 3 before the resume" in (cfg.train_dir / "train_report.md").read_text()


def test_a_resume_ending_before_the_kept_best_does_not_export_it(tmp_path):
    """Killed after the step-3 validation (the best) with the step-2 checkpoint the newest, then resumed with --stop-at
    2: the run ended at step 2 ("trained: 2/12 optimizer steps (--stop-at 2 ...)") but exported the killed run's
    step-3 weights, a step after its end. A best kept from before the resume that lies past the run's end is now
    dropped."""
    cfg = load_config(
        make_tiny_run(
            tmp_path,
            n_train=8,
            n_val=4,
            train={
                "epochs": 3,
                "eval_every": 1,
                "ckpt_every": 2,
                "keep_checkpoints": 100,
                "select_best": "sim_accept",
                "lr": 5e-2,
            },
        )
    )
    run(cfg, stop_after=3, device="cpu")
    assert json.loads((cfg.train_dir / CURVE_FILE).read_text())["best"]["step"] == 3
    (
        ckpt.ckpt_dir(cfg.train_dir) / "step_00000003.pt"
    ).unlink()  # the kill: no checkpoint after the validation
    at2 = safe_torch_load(ckpt.ckpt_dir(cfg.train_dir) / "step_00000002.pt")["model"]
    r = run(cfg, resume=True, device="cpu", export=export_for_run, stop_at=2)
    assert (
        r["step"] == 2
        and r["sim_accept"]["exported_step"] == 2
        and r["sim_accept"]["best"]["step"] == 2
    )
    exported = load_file(str(cfg.export_dir / "model.safetensors"))
    assert torch.equal(exported["fc.weight"], at2["fc.weight"].bfloat16())
    assert safe_torch_load(cfg.train_dir / BEST_FILE)["step"] == 2


def _kill_between_best_file_and_curve(tmp_path) -> "_Tiny":
    """Validations at steps 10 (tau_sim low) and 20 (high, weights filled with 4.0), then the kill between
    best_drafter.pt and sim_accept.json: the file holds step 20's weights, the curve of before names step 10."""
    m = _Tiny()
    tr = BestTracker(tmp_path, chain=3, enabled=True, keep_best=True)
    tr.update(10, 0, _val(0.5, 0.5, 0.5), m)
    curve = (tmp_path / CURVE_FILE).read_text()
    with torch.no_grad():
        m.w.fill_(4.0)
    tr.update(20, 1, _val(0.9, 0.9, 0.9), m)
    (tmp_path / CURVE_FILE).write_text(curve)  # the kill
    return m


def test_a_kill_between_the_best_file_and_the_curve_resumes_with_the_file_s_best(tmp_path):
    """update() writes best_drafter.pt, then sim_accept.json: a kill between the two left the file with step 20's
    weights and the curve naming step 10 as the best, and a resume reported step 10 while exporting step 20's
    weights (--export-only refused the mismatch). The file records its row, and a resume takes it."""
    m = _kill_between_best_file_and_curve(tmp_path)
    r = BestTracker(tmp_path, chain=3, enabled=True, start_step=15, keep_best=True)
    assert (
        r.best["step"] == 20
        and r.best["tau_sim"] == pytest.approx(3.439)
        and r.best["before_resume"] is True
    )
    assert r.restore_best(m) == 20 and r.summary()["best"]["alpha"] == [0.9, 0.9, 0.9]


def test_export_only_after_a_kill_between_the_best_file_and_the_curve_exports_the_file_s_best(
    tmp_path,
):
    """The same kill, then ``04 --export-only`` instead of a resume: it refused (``holds the weights of step 20, but
    sim_accept.json names step 10 as the best``) though the file records its validation and a resume takes it; it now
    exports the file's weights, as the resumed run would."""
    from eagle3.train.sim_accept import load_best_for_export

    _kill_between_best_file_and_curve(tmp_path)
    out = _Tiny()
    assert load_best_for_export(tmp_path, out, ckpt_step=15) == (20, None)
    assert torch.equal(out.w.detach(), torch.full((3,), 4.0))
    assert (
        json.loads((tmp_path / CURVE_FILE).read_text())["best"]["step"] == 10
    )  # --export-only changes nothing


def test_a_kill_between_the_first_best_file_and_the_first_curve_keeps_that_best(tmp_path):
    """A kill after the first validation's best_drafter.pt, before sim_accept.json existed: the resume deleted the file
    (no curve: taken for a fresh start), so that validation's weights were lost; it now keeps them as the best."""
    m = _Tiny()
    with torch.no_grad():
        m.w.fill_(5.0)
    BestTracker(tmp_path, chain=3, enabled=True, keep_best=True).update(
        10, 0, _val(0.8, 0.5, 0.5), m
    )
    (
        tmp_path / CURVE_FILE
    ).unlink()  # the kill: the curve of the first validation was never written
    r = BestTracker(tmp_path, chain=3, enabled=True, start_step=6, keep_best=True)
    assert r.rows == [] and r.best["step"] == 10 and r.best["before_resume"] is True
    assert r.best["tau_sim"] == pytest.approx(1 + 0.8 + 0.4 + 0.2)
    with torch.no_grad():
        m.w.fill_(0.0)
    assert r.restore_best(m) == 10 and torch.equal(m.w.detach(), torch.full((3,), 5.0))
    assert not r.update(
        8, 0, _val(0.5, 0.5, 0.5), m
    )  # a lower validation of the resumed run keeps it
    # a fresh start (step 0) still removes it
    BestTracker(tmp_path, chain=3, enabled=True, start_step=0, keep_best=True)
    assert not (tmp_path / BEST_FILE).exists()


def _trainable(d) -> dict:
    return {n: p.detach().clone() for n, p in d.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("select", ["sim_accept", "last"])
def test_training_exports_the_selected_weights_and_reports_the_curve(tmp_path, select):
    path = make_tiny_run(
        tmp_path,
        n_train=8,
        n_val=4,
        train={"epochs": 3, "eval_every": 1, "ckpt_every": 100, "select_best": select, "lr": 5e-2},
    )
    cfg = load_config(path)
    r = run(cfg, device="cpu", export=export_for_run)
    total = r["total_steps"]
    rep = json.loads((cfg.train_dir / "train_report.json").read_text())
    sa = rep["sim_accept"]
    assert sa["chain"] == cfg.benchmark.steps == 3 and sa["select_best"] == select
    assert [row["step"] for row in sa["rows"]] == list(
        range(1, total + 1)
    )  # every step, the last one included
    best = max(sa["rows"], key=lambda row: row["tau_sim"])
    assert sa["best"]["step"] == best["step"]
    for row in sa["rows"]:
        assert row["tau_sim"] == pytest.approx(simulated_tau(row["alpha"], 3))
    assert (cfg.train_dir / PLOT_FILE).is_file()
    assert "tau_sim(3)" in (cfg.train_dir / "train_report.md").read_text()
    # the val rows of metrics.jsonl are the curve's alphas
    val_rows = [json.loads(x) for x in (cfg.train_dir / "metrics.jsonl").read_text().splitlines()]
    val_rows = {v["step"]: v for v in val_rows if v["kind"] == "val"}
    assert sa["rows"][0]["alpha"][0] == pytest.approx(val_rows[1]["acc_0"], abs=1e-6)
    exported = load_file(str(cfg.export_dir / "model.safetensors"))
    if select == "sim_accept":
        want = safe_torch_load(cfg.train_dir / BEST_FILE)
        assert want["step"] == best["step"] == sa["exported_step"]
        assert (
            best["step"] != total
        )  # (this seed's best is early: the check below tells best from last)
        ref = want["model"]
    else:
        assert sa["exported_step"] is None and not (cfg.train_dir / BEST_FILE).exists()
        ref = ckpt.find_latest_checkpoint(cfg.train_dir)[1]["model"]
    assert torch.equal(exported["fc.weight"], ref["fc.weight"].bfloat16())
    assert torch.equal(
        exported["midlayer.mlp.up_proj.weight"], ref["midlayer.mlp.up_proj.weight"].bfloat16()
    )
    # --export-only writes the same weights again
    out = export_from_checkpoint(cfg, engine="vllm")
    again = load_file(str(out / "model.safetensors"))
    assert torch.equal(again["fc.weight"], exported["fc.weight"])
    d = load_exported(cfg.export_dir, embed_weight=torch.zeros(48, 16))
    assert d.args.variant == "eagle3"


def test_closing_lines_and_report_name_the_exported_step_when_it_is_not_the_last(tmp_path, capsys):
    """select_best: sim_accept exporting an earlier step's weights: 04's closing lines gave only the last step's
    validation loss and top-1 above `export: <folder>`, and the demo summary the same, though the folder held the
    best validation's weights (fresh-user trial 2026-12-05f). A line now names the exported step and its figures."""
    import importlib.util

    path = make_tiny_run(
        tmp_path,
        n_train=8,
        n_val=4,
        train={
            "epochs": 3,
            "eval_every": 1,
            "ckpt_every": 100,
            "select_best": "sim_accept",
            "lr": 5e-2,
        },
    )
    cfg = load_config(path)
    r = run(cfg, device="cpu", export=export_for_run)
    sa = r["sim_accept"]
    best, last = sa["best"], [row for row in sa["rows"] if row["step"] == r["step"]][0]
    assert sa["exported_step"] == best["step"] != r["step"]  # (this seed's best is early)
    want = (
        f"exported: the weights of step {best['step']}, not the last step's (train.select_best: sim_accept: the "
        f"best validation, tau_sim(3) {best['tau_sim']:.4f} against {last['tau_sim']:.4f} at step {r['step']}; "
        f"its validation loss {best['loss']:.4f}, top-1 {' / '.join(f'{a:.3f}' for a in best['alpha'])})"
    )
    lines = capsys.readouterr().out.splitlines()
    assert lines[-5].startswith(f"trained: {r['step']}/") and lines[-4] == want
    assert lines[-1] == f"export: {cfg.export_dir}"
    assert f"- {want}" in (cfg.train_dir / "train_report.md").read_text().splitlines()
    script = Path(__file__).parents[2] / "scripts" / "demo_summary.py"
    spec = importlib.util.spec_from_file_location("demo_summary", script)
    ds = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ds)
    fig, text, _ = ds._train(cfg)
    assert fig["exported_step"] == best["step"] and text.endswith(
        f"; exported: step {best['step']}'s weights (best simulated acceptance; the figures above are the last step's)"
    )
    cfg_last = load_config(
        make_tiny_run(
            tmp_path / "last",
            n_train=8,
            n_val=4,
            train={
                "epochs": 3,
                "eval_every": 1,
                "ckpt_every": 100,
                "select_best": "last",
                "lr": 5e-2,
            },
        )
    )
    run(cfg_last, device="cpu", export=export_for_run)
    assert not [x for x in capsys.readouterr().out.splitlines() if x.startswith("exported:")]


def test_eagle31_trains_resumes_and_exports(tmp_path):
    """drafter.variant: eagle3.1 end to end on CPU: train, stop, resume (same result as uninterrupted), export."""
    sets = ["drafter.variant=eagle3.1", "train.loss=lk_hybrid"]
    whole = load_config(make_tiny_run(tmp_path / "a", train={"epochs": 2}), sets)
    ra = run(whole, device="cpu", export=export_for_run)
    part = load_config(make_tiny_run(tmp_path / "b", train={"epochs": 2}), sets)
    run(part, stop_after=3, device="cpu")
    rb = run(part, resume=True, device="cpu", export=export_for_run)
    assert ra["step"] == rb["step"] == ra["total_steps"]
    wa = load_file(str(whole.export_dir / "model.safetensors"))
    wb = load_file(str(part.export_dir / "model.safetensors"))
    assert {"fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight"} <= set(wa)
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
    assert (
        float((wa["fc_norm.1.weight"].float() - 1).abs().max()) > 0
    )  # the per-aux norms were trained
    cfg = json.loads((whole.export_dir / "config.json").read_text())
    assert cfg["fc_norm"] is True and cfg["norm_output"] is True
    assert (
        load_exported(whole.export_dir, embed_weight=torch.zeros(48, 16)).args.variant == "eagle3.1"
    )
    # resuming the 3.1 checkpoint as an eagle3 drafter is refused, naming the key
    from eagle3.errors import UserError

    with pytest.raises(
        UserError, match="drafter field 'variant' is 'eagle3.1' in the checkpoint but 'eagle3'"
    ):
        run(
            load_config(tmp_path / "b" / "run.yaml", ["train.loss=lk_hybrid"]),
            resume=True,
            device="cpu",
        )


def test_report_of_a_stopped_run_says_what_export_only_will_export():
    """A run stopped before its export wrote "exported step: the last" beside "export: None" in train_report.md,
    while `04 --export-only` exports the best validation (lease 2026-12-04e: step 6,000 of a run stopped at 6,007)."""
    from eagle3.train.sim_accept import markdown_lines

    rows = [
        {"step": 5000, "alpha": [0.89, 0.88, 0.88], "tau_sim": 3.38, "loss": 4.1},
        {"step": 6000, "alpha": [0.9, 0.89, 0.89], "tau_sim": 3.41, "loss": 4.0},
    ]
    base = {"chain": 3, "rows": rows, "best": rows[1]}
    head = lambda s: markdown_lines(s)[0]  # noqa: E731
    assert head(dict(base, select_best="sim_accept", exported_step=None, stopped=True)).endswith(
        "(select_best: sim_accept; exported step: none yet; `--export-only` exports step 6000, the best):"
    )
    assert head(dict(base, select_best="last", exported_step=None, stopped=True)).endswith(
        "(select_best: last; exported step: none yet; `--export-only` exports the checkpoint):"
    )
    assert head(dict(base, select_best="sim_accept", exported_step=6000)).endswith(
        "exported step: 6000):"
    )
    assert head(dict(base, select_best="last", exported_step=None)).endswith(
        "exported step: the last):"
    )
    assert "| 6000 (best) | 3.4100 |" in "\n".join(
        markdown_lines(dict(base, select_best="sim_accept", exported_step=6000))
    )


def test_export_only_keeps_best_drafter_and_exports_it_after_a_checkpoint_fallback(
    tmp_path, caplog
):
    """--export-only whose newest checkpoints do not load falls back to an older one (step 4); it used to build a
    BestTracker for that step, which DELETED the later best_drafter.pt and exported the step-4 weights. Now it reads
    the best file without touching it and exports the weights the training exported; a corrupt best file is a
    one-line error with nothing exported."""
    import logging

    path = make_tiny_run(
        tmp_path,
        n_train=8,
        n_val=4,
        train={
            "epochs": 3,
            "eval_every": 1,
            "ckpt_every": 2,
            "keep_checkpoints": 10,
            "select_best": "sim_accept",
            "lr": 2e-3,
        },
    )
    cfg = load_config(path)
    run(cfg, device="cpu", export=export_for_run)
    best = safe_torch_load(cfg.train_dir / BEST_FILE)
    assert best["step"] > 4  # (this seed's best is after the checkpoint the export falls back to)
    trained = load_file(str(cfg.export_dir / "model.safetensors"))
    for step, p in ckpt.list_checkpoints(cfg.train_dir):
        if step > 4:
            p.write_bytes(p.read_bytes()[:100])
    kept = {p.name: p.read_bytes() for p in (cfg.train_dir / BEST_FILE, cfg.train_dir / CURVE_FILE)}
    with caplog.at_level(logging.INFO):
        out = export_from_checkpoint(cfg, engine="vllm")
    assert "using step_00000004.pt (step 4)" in caplog.text
    assert {
        p.name: p.read_bytes() for p in (cfg.train_dir / BEST_FILE, cfg.train_dir / CURVE_FILE)
    } == kept
    again = load_file(str(out / "model.safetensors"))
    assert torch.equal(again["fc.weight"], trained["fc.weight"])
    assert torch.equal(again["fc.weight"], best["model"]["fc.weight"].bfloat16())
    # a best file that does not load: one line naming it and the way out; the vLLM export is not replaced
    bf = cfg.train_dir / BEST_FILE
    bf.write_bytes(bf.read_bytes()[:50])
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    with pytest.raises(
        UserError,
        match=rf"^{bf}: truncated or corrupt torch file.*; set train.select_best=last to "
        r"export the checkpoint \(step 4\) instead$",
    ):
        export_from_checkpoint(cfg, engine="vllm")
    assert bf.is_file() and (out / "model.safetensors").stat().st_mtime_ns == stamp


def test_sim_accept_without_anything_to_select_warns_naming_the_field(tmp_path, caplog):
    """select_best: sim_accept silently did nothing (a) without a validation split and (b) on --export-only of a run
    trained with select_best: last. Now a warning names the field and what is exported instead (in train_report
    too, where there is one)."""
    import logging

    cfg = load_config(
        make_tiny_run(tmp_path / "a", n_val=0, train={"epochs": 1, "select_best": "sim_accept"})
    )
    with caplog.at_level(logging.WARNING):
        r = run(cfg, device="cpu", export=export_for_run)
    want = "train.select_best: sim_accept has no validation split to select from"
    assert want in caplog.text and r["sim_accept"]["exported_step"] is None
    rep = json.loads((cfg.train_dir / "train_report.json").read_text())
    assert len(rep["warnings"]) == 1 and rep["warnings"][0].startswith(want)
    assert f"- **warning**: {want}" in (cfg.train_dir / "train_report.md").read_text()
    # (b): trained with last, exported with sim_accept: the checkpoint's weights, with a warning
    last = load_config(make_tiny_run(tmp_path / "b", train={"epochs": 1, "select_best": "last"}))
    run(last, device="cpu")
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        out = export_from_checkpoint(
            last.model_copy(
                update={"train": last.train.model_copy(update={"select_best": "sim_accept"})}
            )
        )
    assert (
        "train.select_best: sim_accept, but" in caplog.text
        and "exporting the checkpoint's weights (step 4)" in caplog.text
    )
    ref = ckpt.find_latest_checkpoint(last.train_dir)[1]["model"]
    assert torch.equal(
        load_file(str(out / "model.safetensors"))["fc.weight"], ref["fc.weight"].bfloat16()
    )


def test_eval_every_not_below_the_run_warns_that_only_the_last_step_can_be_selected(tmp_path):
    """train.eval_every 100 on a 6-step run with select_best: sim_accept: only the final validation ran and the last
    step was exported without a word (the selection had one candidate); now a warning says so (report included)."""
    cfg = load_config(
        make_tiny_run(
            tmp_path,
            n_train=6,
            n_val=2,
            train={"epochs": 2, "eval_every": 100, "select_best": "sim_accept"},
        )
    )
    r = run(cfg, device="cpu")
    assert r["total_steps"] == 6 and [row["step"] for row in r["sim_accept"]["rows"]] == [6]
    want = (
        "train.eval_every 100 is not below the run's 6 optimizer steps: only the final validation runs and "
        "train.select_best: sim_accept has only that one to select from"
    )
    assert [w for w in r["warnings"] if w.startswith(want)]
    assert (
        json.loads((cfg.train_dir / "train_report.json").read_text())["warnings"] == r["warnings"]
    )
    # an eval_every below the run's steps says nothing, nor one above it under select_best: last (no selection)
    for name, train in (
        ("b", {"eval_every": 5, "select_best": "sim_accept"}),
        ("c", {"eval_every": 100}),
    ):
        quiet = load_config(
            make_tiny_run(tmp_path / name, n_train=6, n_val=2, train={"epochs": 2, **train})
        )
        assert not [w for w in run(quiet, device="cpu")["warnings"] if "train.eval_every" in w]


def test_chain_longer_than_ttt_is_capped_labelled_and_warned(tmp_path):
    """benchmark.steps 3 (select_chain's default) over ttt_length 2: tau_sim(2) is what can be scored, and it is
    labelled tau_sim(2) in sim_accept.json and the report, with one warning; an explicit select_chain 3 is refused."""
    from eagle3.train.sim_accept import effective_chain

    assert effective_chain(None, 3, 7) == (3, None) and effective_chain(5, 3, 7) == (5, None)
    k, warning = effective_chain(None, 7, 3)
    assert k == 3 and "tau_sim(3), not tau_sim(7)" in warning and "benchmark.steps" in warning
    assert simulated_tau([0.5, 0.4], k) == pytest.approx(1 + 0.5 + 0.5 * 0.4)  # 1.7
    path = make_tiny_run(
        tmp_path, n_train=4, n_val=2, train={"ttt_length": 2, "epochs": 1, "eval_every": 1}
    )
    with pytest.raises(
        UserError, match=r"field 'train.select_chain': 3 is longer than train.ttt_length 2"
    ):
        load_config(path, ["train.select_chain=3"])
    cfg = load_config(path)
    assert cfg.benchmark.steps == 3 and cfg.train.select_chain is None
    run(cfg, device="cpu")
    sa = json.loads((cfg.train_dir / CURVE_FILE).read_text())
    assert sa["chain"] == 2
    for row in sa["rows"]:
        a1, a2 = row["alpha"]
        assert row["tau_sim"] == pytest.approx(1 + a1 + a1 * a2)
    rep = json.loads((cfg.train_dir / "train_report.json").read_text())
    assert sum("tau_sim(2), not tau_sim(3)" in w for w in rep["warnings"]) == 1
    md = (cfg.train_dir / "train_report.md").read_text()
    assert "| tau_sim(2) |" in md and "tau_sim(3)" not in md.replace("not tau_sim(3)", "")


def test_no_validation_split_is_said_plainly_not_an_empty_tau_table(tmp_path, capsys):
    """data.val_fraction 0 (no 'val' samples in split.json): train_report.md had a simulated-acceptance heading over
    an empty table. It now says in one line that there is no validation split (naming data.val_fraction) and that
    the export holds the last step's weights; train_report.json records ``val_samples: 0`` and the same sentence, and
    04's closing lines say it too. A run stopped before its first validation gets one line instead of the table."""
    from eagle3.train.sim_accept import markdown_lines

    cfg = load_config(make_tiny_run(tmp_path, n_val=0, train={"epochs": 1}))
    r = run(cfg, device="cpu", export=export_for_run)
    note = (
        f"no validation split (data.val_fraction is 0: stage 03's split.json has no 'val' samples), so no "
        f"validation loss, accuracy or simulated acceptance (tau); the export holds the last step's weights "
        f"(step {r['step']}); set data.val_fraction > 0 and re-run 03 and 04 to measure them"
    )
    assert r["step"] == 4
    md = (cfg.train_dir / "train_report.md").read_text()
    assert f"Validation: {note}." in md and "tau_sim" not in md and "|---:|" not in md
    rep = json.loads((cfg.train_dir / "train_report.json").read_text())
    assert rep["val_samples"] == 0 and rep["no_validation"] == note
    assert f"trained: 4/4 optimizer steps; {note}" in capsys.readouterr().out
    with_val = load_config(make_tiny_run(tmp_path / "v", train={"epochs": 1}))
    run(with_val, device="cpu")
    rep = json.loads((with_val.train_dir / "train_report.json").read_text())
    assert rep["val_samples"] == 2 and "no_validation" not in rep
    assert "| step | tau_sim(" in (with_val.train_dir / "train_report.md").read_text()
    assert markdown_lines({"chain": 3, "rows": [], "select_best": "last", "stopped": True}) == [
        "Simulated acceptance length on the validation split, tau_sim(3): not measured (no validation ran before the "
        "run stopped; select_best: last; exported step: none yet; `--export-only` exports the checkpoint)."
    ]


def test_a_stopped_run_without_validation_split_says_so_without_an_exported_step(tmp_path):
    """A run without a validation split stopped by stop_after (as by a signal) has no export yet: its report says
    there is no validation split and that a later export holds the last step's weights, with no tau table."""
    cfg = load_config(make_tiny_run(tmp_path, n_val=0, train={"epochs": 1}))
    r = run(cfg, device="cpu", stop_after=1)
    assert r["stopped"] and r["step"] == 1
    md = (cfg.train_dir / "train_report.md").read_text()
    assert (
        "Validation: no validation split (data.val_fraction is 0: stage 03's split.json has no 'val' samples), so "
        "no validation loss, accuracy or simulated acceptance (tau); an export (at the end of `--resume`, or "
        "`--export-only`) holds the last step's weights; set data.val_fraction > 0"
    ) in md
    assert "tau_sim" not in md


def test_export_only_rewrites_the_report_of_the_stopped_run_it_exports(tmp_path, caplog):
    """A run stopped by a signal and then exported by `04 --export-only` kept a train_report.md saying "export: none
    ... `--export-only` exports step N" (lease 2026-12-05e: both A/B drafters, exported at step 1,000 of runs stopped
    at 1,170 / 1,252). --export-only now records the export in train_report.{json,md}: the folder, the checkpoint and
    the step whose weights it holds; a report written at another step is left alone with a warning."""
    import logging

    cfg = load_config(
        make_tiny_run(
            tmp_path,
            n_train=8,
            n_val=4,
            train={
                "epochs": 3,
                "eval_every": 1,
                "ckpt_every": 1,
                "select_best": "sim_accept",
                "lr": 2e-3,
            },
        )
    )
    r = run(cfg, device="cpu", stop_after=4)
    assert r["stopped"] and r["step"] == 4
    best_step = safe_torch_load(cfg.train_dir / BEST_FILE)["step"]
    before = json.loads((cfg.train_dir / "train_report.json").read_text())
    assert before["export_dir"] is None and before["sim_accept"]["exported_step"] is None
    out = export_from_checkpoint(cfg)
    rep = json.loads((cfg.train_dir / "train_report.json").read_text())
    ck = str(cfg.train_dir / "checkpoints" / "step_00000004.pt")
    assert rep["export_dir"] == str(out) and rep["step"] == 4 and rep["stopped"]
    assert rep["export_only"] == {
        "checkpoint": ck,
        "weights_step": best_step,
        "engine": cfg.export.engine,
    }
    assert (
        rep["sim_accept"]["exported_step"] == best_step
        and rep["drafter_args"] == before["drafter_args"]
    )
    md = (cfg.train_dir / "train_report.md").read_text()
    assert f"- export: `{out}`" in md
    assert (
        "- **stopped** by signal None at step 4: no final validation, exported afterwards by `--export-only`"
        in md
    )
    assert (
        f"- exported by `04_train.py --export-only` ({cfg.export.engine}): the weights of step {best_step} "
        f"(checkpoint `{ck}`)"
    ) in md
    assert f"exported step: {best_step}):" in md and "none yet" not in md
    # a report of another step (an older run's) is not rewritten
    (cfg.train_dir / "train_report.json").write_text(json.dumps(dict(before, step=3)))
    with caplog.at_level(logging.WARNING):
        export_from_checkpoint(cfg)
    assert "written at step 3, not at the exported checkpoint's step 4" in caplog.text
    assert json.loads((cfg.train_dir / "train_report.json").read_text())["export_dir"] is None


def test_export_only_for_the_other_engine_keeps_the_first_export_in_the_report(tmp_path):
    """A finished run (export drafter-sglang) then `04 --export-only --engine vllm --set train.select_best=last`: the
    report said only `export: drafter-vllm`, forgetting the SGLang export still there, and its tau table kept the
    training's `select_best: sim_accept` beside the step `last` exported (fresh-user trial 2026-12-05e). Both exports
    are now listed, each with its step and select_best, and the table says what this export selected."""
    run_yaml = make_tiny_run(
        tmp_path,
        n_train=8,
        n_val=4,
        train={
            "epochs": 3,
            "eval_every": 1,
            "ckpt_every": 1,
            "select_best": "sim_accept",
            "lr": 2e-3,
        },
    )
    cfg = load_config(run_yaml)
    r = run(cfg, device="cpu", export=export_for_run)
    first = json.loads((cfg.train_dir / "train_report.json").read_text())
    sg = Path(first["export_dir"])
    best = first["sim_accept"]["exported_step"]
    assert sg.is_dir() and not r.get("stopped")
    cfg2 = load_config(run_yaml, ["export.engine=vllm", "train.select_best=last"])
    out = export_from_checkpoint(cfg2)
    assert out != sg
    rep = json.loads((cfg.train_dir / "train_report.json").read_text())
    assert rep["export_dir"] == str(out) and rep["export_only"]["engine"] == "vllm"
    assert rep["other_exports"] == [
        {
            "export_dir": str(sg),
            "engine": cfg.export.engine,
            "weights_step": best,
            "select_best": "sim_accept",
        }
    ]
    assert (
        rep["sim_accept"]["select_best"] == "last"
        and rep["sim_accept"]["exported_step"] == r["step"]
    )
    md = (cfg.train_dir / "train_report.md").read_text()
    assert (
        f"- also exported: `{sg}` ({cfg.export.engine}, the weights of step {best}, select_best: sim_accept)"
        in md
    )
    assert f"(select_best: last; exported step: {r['step']}):" in md
    # exporting for SGLang again lists the vLLM folder instead, never the folder itself
    export_from_checkpoint(cfg)
    rep = json.loads((cfg.train_dir / "train_report.json").read_text())
    assert rep["export_dir"] == str(sg) and [o["export_dir"] for o in rep["other_exports"]] == [
        str(out)
    ]


def test_report_table_has_one_alpha_column_per_chain_position():
    """train_report.md's tau_sim table always had columns alpha_1..alpha_3: a `ttt_length: 2` run showed an
    `alpha_3` of `nan`, and a chain of 7 hid alpha_4..alpha_7 that its tau_sim(7) is computed from."""
    from eagle3.train.sim_accept import markdown_lines

    two = [{"step": 8, "alpha": [0.049, 0.014], "tau_sim": 1.0497, "loss": 12.1}]
    text = "\n".join(
        markdown_lines(
            {
                "chain": 2,
                "rows": two,
                "best": two[0],
                "select_best": "sim_accept",
                "exported_step": 8,
            }
        )
    )
    assert (
        "| step | tau_sim(2) | alpha_1 | alpha_2 | val loss |\n|---:|---:|---:|---:|---:|" in text
    )
    assert "| 8 (best) | 1.0497 | 0.0490 | 0.0140 | 12.1000 |" in text and "nan" not in text
    seven = [
        {"step": 40, "alpha": [0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3], "tau_sim": 3.3, "loss": 4.0}
    ]
    text = "\n".join(
        markdown_lines({"chain": 7, "rows": seven, "best": seven[0], "select_best": "last"})
    )
    assert (
        "| alpha_7 | val loss |" in text
        and "| 40 (best) | 3.3000 | 0.9000 | 0.8000 | 0.7000 | 0.6000 | 0.5000 | "
        "0.4000 | 0.3000 | 4.0000 |"
        in text
    )
    short = [
        {"step": 5, "alpha": [0.5], "tau_sim": 1.5, "loss": 1.0}
    ]  # fewer positions than the chain: a dash
    assert "| 5 | 1.5000 | 0.5000 | - | 1.0000 |" in "\n".join(
        markdown_lines({"chain": 2, "rows": short})
    )


def test_markdown_has_an_alpha_column_per_trained_position_only():
    """A run with train.ttt_length 2 (two TTT positions) printed an alpha_3 column of nan in train_report.md (trial
    2026-12-05h: `| 6 (best) | 3.0000 | 1.0000 | 1.0000 | nan | 11.1618 |`); the table now has the positions the
    run trained, up to 3."""
    from eagle3.train.sim_accept import markdown_lines

    row = {"step": 6, "epoch": 0, "alpha": [0.75, 0.5], "loss": 11.5, "tau_sim": 2.125}
    lines = markdown_lines(
        {"chain": 2, "rows": [row], "best": row, "select_best": "last", "exported_step": None}
    )
    assert lines[2:] == [
        "| step | tau_sim(2) | alpha_1 | alpha_2 | val loss |",
        "|---:|---:|---:|---:|---:|",
        "| 6 (best) | 2.1250 | 0.7500 | 0.5000 | 11.5000 |",
    ]
    row7 = dict(row, alpha=[0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3], tau_sim=3.0)
    lines = markdown_lines(
        {"chain": 3, "rows": [row7], "best": row7, "select_best": "last", "exported_step": None}
    )
    assert lines[2] == "| step | tau_sim(3) | alpha_1 | alpha_2 | alpha_3 | val loss |"
    assert lines[4] == "| 6 (best) | 3.0000 | 0.9000 | 0.8000 | 0.7000 | 11.5000 |"
