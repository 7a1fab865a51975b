"""Copy the small results of one ``bench/gpu_session.sh`` lease into a committed ``bench/results/<dated>/`` folder.

Input: the ``res/`` folder of the session's ``results.tar.gz`` (``tar -xzf results.tar.gz -C DIR`` gives
``DIR/res`` and ``DIR/status``). Output (``--out``):

- the real run, flat (the layout ``bench/quality_summary.py`` reads): ``bench-steps{K}.json`` / ``.md``
  for each ``real/bench-steps{K}``, ``bench-shift.json`` / ``.md``, ``per_prompt_steps3.json``,
  ``train_report.json``, ``data_report.json``, ``data_config.json``, ``prompts_report.json``;
- every derived run (curve, ablations, fp8) under ``runs/<name>/``: ``bench.json`` / ``.md``,
  ``per_prompt.json``, ``train_report.json``, ``data_report.json`` (whichever exist);
- the session's bench JSONs (``capture_*.json``, ``bench_speed.json``, ``fp8_convert.json``, ...) and
  ``phases.json``: every phase's wall seconds and status (``status/*.done`` / ``*.failed``).

05's ``bench.json`` keeps its per-prompt rows (accepted length per verify round, ~0.5-1 MB per run);
here they are reduced to ``{"per_prompt": {set: {id: [emitted tokens, verify steps]}}}`` (what tau by
category and the paired bootstrap of ``bench/quality_compare.py`` need) and dropped from ``bench.json``.

    python bench/collect_session.py outputs/gpu-20261201b --out bench/results/h200-20261201b
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle3.cli import ArgumentParser, run_main  # noqa: E402
from eagle3.errors import UserError  # noqa: E402
from eagle3.io import atomic_write_json, make_dirs  # noqa: E402


def split_bench(bench: dict) -> tuple[dict, dict]:
    """``(bench without per-prompt rows, {"per_prompt": {set: {id: [emitted, verify steps]}}})``.

    ``emitted`` = sum of the row's accept lengths (tokens the verify rounds emitted), ``verify steps``
    = number of rounds; a set's tau is ``sum(emitted) / sum(steps)`` over its prompts.
    """
    slim = dict(bench)
    slim["datasets"] = [
        {k: v for k, v in ds.items() if k != "per_prompt"} for ds in bench["datasets"]
    ]
    pp = {
        ds["dataset"]: {
            str(r["id"]): [int(sum(r["accept_lengths"])), len(r["accept_lengths"])]
            for r in ds.get("per_prompt", [])
        }
        for ds in bench["datasets"]
    }
    return slim, {"steps": bench.get("steps"), "per_prompt": pp}


def _copy_bench(src: Path, dst_json: Path, dst_pp: Path) -> None:
    bench = json.loads(src.read_text())
    slim, pp = split_bench(bench)
    atomic_write_json(dst_json, slim)
    atomic_write_json(dst_pp, pp)
    md = src.with_suffix(".md")
    if md.is_file():
        shutil.copyfile(md, dst_json.with_suffix(".md"))


def collect(session: Path, out: Path) -> dict:
    """Copy ``session/res`` (and ``session/status``) into ``out``; returns ``phases.json``'s dict.

    Raises:
        UserError: ``session/res`` is missing.
    """
    res = session / "res"
    if not res.is_dir():
        raise UserError(
            f"{res}: not found (extract the session's results.tar.gz into {session} first)"
        )
    make_dirs(out, "--out")
    real = res / "real"
    for d in sorted(real.glob("bench*")):
        if (d / "bench.json").is_file():
            tag = d.name.replace("bench-", "")
            _copy_bench(
                d / "bench.json", out / f"bench-{tag}.json", out / (f"per_prompt_{tag}.json")
            )
    for sub, name in (
        ("train", "train_report.json"),
        ("data", "data_report.json"),
        ("shards", "data_config.json"),
        ("real", "prompts_report.json"),
    ):
        f = real / sub / name if sub != "real" else real / name
        if f.is_file():
            shutil.copyfile(f, out / name)
    for r in sorted(p for p in res.iterdir() if p.is_dir() and p.name != "real"):
        dst = out / "runs" / r.name
        for d in sorted(r.glob("bench*")):
            if (d / "bench.json").is_file():
                dst.mkdir(parents=True, exist_ok=True)
                _copy_bench(d / "bench.json", dst / "bench.json", dst / "per_prompt.json")
        for sub, name in (("train", "train_report.json"), ("data", "data_report.json")):
            if (r / sub / name).is_file():
                dst.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(r / sub / name, dst / name)
    for f in sorted(res.glob("*.json")):
        shutil.copyfile(f, out / f.name)
    phases = {}
    for f in sorted((session / "status").glob("*")):
        if f.suffix in (".done", ".failed"):
            text = f.read_text().strip()
            phases.setdefault(f.stem, []).append({"status": f.suffix[1:], "record": text})
    atomic_write_json(
        out / "phases.json",
        {
            "what": "bench/gpu_session.sh phases: wall seconds (and rc when failed)",
            "phases": phases,
        },
    )
    return phases


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("session", type=Path, help="folder holding the extracted res/ and status/")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    phases = collect(a.session, a.out)
    print(
        f"{a.out}: {sum(1 for v in phases.values() if any(x['status'] == 'done' for x in v))} phases done, "
        f"{sum(1 for v in phases.values() if all(x['status'] == 'failed' for x in v))} failed"
    )
    return 0


if __name__ == "__main__":
    run_main(main)
