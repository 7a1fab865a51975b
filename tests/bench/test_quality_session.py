"""bench/quality_session.sh: what a `wait` / `pack` leaves in $OUT (the GPU lease driver's only way back).

Two faults of lease 2026-12-04 as tests: settings given to `start` alone were unknown to the later `wait`
(SEED set -> the seeded prompts were packed back anyway), and a `wait` that returned mid-run carried ~35 MB of
prompt parts, after which the machine was given back (30 s idle) with the run on it."""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "quality_session.sh"

pytestmark = pytest.mark.skipif(
    shutil.which("bash") is None or shutil.which("setsid") is None, reason="needs bash and setsid"
)

PROMPTS = [
    {
        "id": f"c{i}",
        "messages": [
            {"role": "user", "content": f"q{i}"},
            {"role": "assistant", "content": f"a{i}"},
        ],
    }
    for i in range(5)
]


def _driver(verb: str, env: dict, *args: str) -> subprocess.CompletedProcess:
    base = {
        k: v
        for k, v in os.environ.items()
        if k not in ("SEED", "PACK_LARGE", "PACK_DRAFTER", "OUT", "INIT")
    }
    return subprocess.run(
        ["bash", str(SCRIPT), verb, *args],
        env={**base, "PYTHON": sys.executable, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def _after_01(w: Path) -> None:
    """The state of $W once 01 has run: s01.done and the regenerated prompts."""
    (w / "status").mkdir(parents=True, exist_ok=True)
    (w / "status" / "s01.done").write_text("3\n")
    run = w / "data-run"
    run.mkdir(parents=True, exist_ok=True)
    (run / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    (run / "prompts_report.json").write_text(json.dumps({"counts": {"regenerated": len(PROMPTS)}}))


def _packed_prompts(out: Path) -> list[dict]:
    parts = sorted(out.glob("prompts.jsonl.gz.part*"))
    if not parts:
        return []
    data = gzip.decompress(b"".join(p.read_bytes() for p in parts)).decode()
    return [json.loads(line) for line in data.splitlines()]


def test_pack_mid_run_leaves_the_large_files_behind(tmp_path):
    w, out = tmp_path / "w", tmp_path / "out"
    _after_01(w)
    out.mkdir()
    r = _driver("pack", {"W": str(w), "OUT": str(out)})
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in out.iterdir()) == ["quality-results.tar.gz"]

    out2 = tmp_path / "out2"
    out2.mkdir()
    r = _driver(
        "pack", {"W": str(w), "OUT": str(out2), "PACK_LARGE": "1"}
    )  # asked for: they come back mid-run
    assert r.returncode == 0, r.stderr
    assert _packed_prompts(out2) == PROMPTS
    assert json.loads((out2 / "prompts_report.json").read_text())["counts"]["regenerated"] == 5

    (
        w / "status" / "ALL.done"
    ).touch()  # the driver is done: the last pack brings them back by itself
    out3 = tmp_path / "out3"
    out3.mkdir()
    r = _driver("pack", {"W": str(w), "OUT": str(out3)})
    assert r.returncode == 0, r.stderr
    assert _packed_prompts(out3) == PROMPTS


def test_settings_given_to_start_hold_for_wait(tmp_path):
    w, out, seed = tmp_path / "w", tmp_path / "out", tmp_path / "seed dir"
    seed.mkdir()
    # INIT names no drafter: `start` refuses before it launches anything, its settings already recorded
    r = _driver(
        "start",
        {
            "W": str(w),
            "SEED": str(seed),
            "INIT": str(tmp_path / "missing"),
            "RECIPES": "ref:train.epochs=2 b:train.lr=3e-4",
        },
    )
    assert r.returncode == 1 and "no exported drafter there" in r.stdout, (r.stdout, r.stderr)
    assert not (w / "run.pid").exists() and not (w / "run.log").exists()
    env_file = (w / "driver.env").read_text()
    assert "SEED=" in env_file and "RECIPES=" in env_file and "PACK_LARGE" not in env_file

    # the values round-trip through the file exactly (spaces and quotes included); the caller's own value wins
    probe = 'W="$1"; . "$W/driver.env"; printf "%s|%s" "$SEED" "$RECIPES"'
    got = subprocess.run(
        ["bash", "-c", probe, "x", str(w)],
        capture_output=True,
        text=True,
        env={"PATH": os.environ["PATH"]},
    ).stdout
    assert got == f"{seed}|ref:train.epochs=2 b:train.lr=3e-4"
    got = subprocess.run(
        ["bash", "-c", probe, "x", str(w)],
        capture_output=True,
        text=True,
        env={"PATH": os.environ["PATH"], "SEED": "/other"},
    ).stdout
    assert got.startswith("/other|")
    got = subprocess.run(
        ["bash", "-c", probe, "x", str(w)],
        capture_output=True,
        text=True,
        env={"PATH": os.environ["PATH"], "SEED": ""},
    ).stdout
    assert got.startswith(
        f"{seed}|"
    )  # an empty SEED in a later call's environment is unset, not "no seed"

    _after_01(w)  # as if 01 had run on the seeded prompts
    out.mkdir()
    r = _driver(
        "wait", {"W": str(w), "OUT": str(out)}, "1"
    )  # SEED not given here: the driver's own is used
    assert r.returncode == 0, r.stderr
    assert _packed_prompts(out) == []  # the prompts are the seed's: nothing to bring back
    r = _driver(
        "wait", {"W": str(w), "OUT": str(out), "SEED": ""}, "1"
    )  # an empty SEED there: the same
    assert r.returncode == 0, r.stderr
    assert _packed_prompts(out) == []

    w2, out2 = (
        tmp_path / "w2",
        tmp_path / "out2",
    )  # the same, with no SEED at start: they do come back
    _after_01(w2)
    (w2 / "status" / "ALL.done").touch()
    out2.mkdir()
    r = _driver("wait", {"W": str(w2), "OUT": str(out2)}, "1")
    assert r.returncode == 0, r.stderr
    assert _packed_prompts(out2) == PROMPTS


def test_finish_is_the_deadline_now(tmp_path):
    """`finish` marks the deadline passed before it signals each running 04, so its chain exports and scores the
    checkpoint instead of retrying it (lease 2026-12-04e: a hand-sent SIGTERM without the mark made the chain rerun 04
    with --resume, reloading the verifier)."""
    w = tmp_path / "w"
    (w / "status").mkdir(parents=True)
    got = tmp_path / "got"
    # a stand-in 04: on SIGTERM it records whether the deadline was already marked, then exits as 04 does (143)
    fake = subprocess.Popen(
        [
            "bash",
            "-c",
            f'trap \'[ -e "{w}/deadline.hit" ] && echo marked > "{got}"; exit 143\' TERM; '
            "while :; do sleep 0.1; done",
        ]
    )
    try:
        time.sleep(0.5)
        (w / "status" / "deep_04.pid").write_text(f"{fake.pid}\n")
        r = _driver("finish", {"W": str(w)})
        assert r.returncode == 0, r.stderr
        assert fake.wait(timeout=10) == 143
    finally:
        fake.kill()
    assert (w / "deadline.hit").exists() and got.read_text() == "marked\n"
    assert "SIGTERM sent to the running trainings" in r.stdout


def test_deadline_export_drops_resume(tmp_path):
    """train_until_deadline: a 04 stopped at the deadline (exit 143, deadline marked) is exported with the same command
    plus --export-only and without --resume, which 04 refuses beside --export-only (the chain passes --resume to
    continue a retried run; the lease's deadline export would have failed)."""
    w = tmp_path / "w"
    (w / "status").mkdir(parents=True)
    calls = tmp_path / "calls"
    # records its arguments; the training call "is stopped at the deadline" (the mark made while it trains, exit
    # 143), the export succeeds
    fake = tmp_path / "fake04.sh"
    fake.write_text(
        f'echo "$*" >> "{calls}"\ncase " $* " in *" --export-only "*) exit 0 ;; '
        f'*) touch "{w}/deadline.hit"; exit 143 ;; esac\n'
    )
    fn = subprocess.run(
        [
            "sed",
            "-n",
            "/^train_until_deadline()/,/^}/p",
            str(ROOT / "bench" / "quality_session.sh"),
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert fn.startswith("train_until_deadline()")
    r = subprocess.run(
        [
            "bash",
            "-c",
            fn + f'\nW="{w}"; train_until_deadline deep bash "{fake}" --config c.yaml '
            f"--set a=1 --resume --set b=2",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert calls.read_text().splitlines() == [
        "--config c.yaml --set a=1 --resume --set b=2",
        "--config c.yaml --set a=1 --set b=2 --export-only",
    ]


def test_no_training_starts_after_the_deadline(tmp_path):
    """The deadline watcher signals the 04s running when it fires; a 04 that would start later (a chain queued behind
    SLOTS, or the retry of a failed chain) trained its whole schedule past the deadline (CPU dry run, SLOTS=1:
    `== b_04: start` 19 s after `== deadline: SIGTERM sent`, then all 900 steps). train_until_deadline now runs only
    the export of its checkpoint; a restarted driver whose deadline is still ahead removes an earlier driver's mark."""
    w = tmp_path / "w"
    (w / "status").mkdir(parents=True)
    (w / "deadline.hit").touch()
    calls = tmp_path / "calls"
    fake = tmp_path / "fake04.sh"
    fake.write_text(
        f'echo "$*" >> "{calls}"\ncase " $* " in *" --export-only "*) exit 0 ;; *) sleep 5 ;; esac\n'
    )
    src = _functions("train_until_deadline")
    r = subprocess.run(
        [
            "bash",
            "-c",
            src + f'\nW="{w}"; train_until_deadline late bash "{fake}" --config c.yaml --resume',
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [
        "== late: the deadline has passed; not training, exporting its checkpoint if it has one"
    ]
    assert calls.read_text().splitlines() == ["--config c.yaml --export-only"]
    assert not (w / "status" / "late_04.pid").exists()
    # deadline_left: TRAIN_END_S counts from the driver's first start ($W/t0), DEADLINE_S from now, neither: none
    (w / "t0").write_text(f"{int(time.time()) - 100}\n")
    src = _functions("deadline_left")
    left = {}
    for env in ({"TRAIN_END_S": "1000"}, {"TRAIN_END_S": "50"}, {"DEADLINE_S": "30"}, {}):
        r = subprocess.run(
            ["bash", "-c", src + "\ndeadline_left"],
            capture_output=True,
            text=True,
            timeout=60,
            env={"PATH": os.environ["PATH"], "W": str(w), **env},
        )
        left[next(iter(env.values()), "")] = r.stdout.strip()
    assert (
        left["30"] == "30"
        and left[""] == ""
        and 898 <= int(left["1000"]) <= 900
        and -52 <= int(left["50"]) <= -50
    )


@pytest.mark.slow
def test_a_drafter_over_64_mib_comes_back_in_two_packs(tmp_path):
    """PACK_DRAFTER: an export whose gzipped tarball is over the 4 parts of 15 MiB one call's $OUT can take (a
    two-layer 6,144-wide SmolLM2 export is ~66 MB gzipped) comes back over two `pack` calls, each part once; the
    parts of both calls rebuild the export byte for byte."""
    w = tmp_path / "w"
    _after_01(w)
    (w / "status" / "ALL.done").touch()
    ex = w / "runs" / "deep" / "drafter-sglang"
    ex.mkdir(parents=True)
    (ex / "config.json").write_text('{"architectures": ["LlamaForCausalLMEagle3"]}')
    payload = os.urandom(64 * 2**20)  # incompressible: 5 parts of 15 MiB at most
    (ex / "model.safetensors").write_bytes(payload)
    outs, said = [], []
    for k in range(3):
        out = tmp_path / f"out{k}"
        out.mkdir()
        r = _driver("pack", {"W": str(w), "OUT": str(out), "PACK_DRAFTER": "deep"})
        assert r.returncode == 0, r.stderr
        outs.append(sorted(out.glob("drafter.tar.gz.part*")))
        said.append(next(line for line in r.stdout.splitlines() if line.startswith("== drafter:")))
    assert [len(o) for o in outs] == [4, 1, 0]
    assert said[0].startswith("== drafter: 4 parts in $OUT, 1 more: run `") and said[0].endswith(
        " pack` again (warm machine)"
    )
    assert said[1] == "== drafter: 1 parts in $OUT, all sent (5 in all)"
    names = [p.name for o in outs for p in o]
    assert names == [f"drafter.tar.gz.part{i:02d}" for i in range(5)]  # each part once, in order
    assert all(p.stat().st_size <= 15 * 2**20 for o in outs for p in o)
    assert not list(
        (tmp_path / "out0").glob("prompts.jsonl.gz.part*")
    )  # the drafter takes the place of the prompts
    back = tmp_path / "back"
    back.mkdir()
    cat = subprocess.run(
        ["bash", "-c", f"cat {' '.join(str(p) for o in outs for p in o)} | tar -xzf - -C {back}"],
        capture_output=True,
        text=True,
    )
    assert cat.returncode == 0, cat.stderr
    assert (back / "model.safetensors").read_bytes() == payload
    assert (back / "config.json").read_text() == (ex / "config.json").read_text()


def test_a_restart_keeps_the_settings_of_the_first_start(tmp_path):
    """`stop`, then `start` in a later device call (no plan sourced): the settings the first `start` recorded are kept
    (and reach the launched driver), those given again win; a restart wrote an empty driver.env and ran the defaults
    (another CONFIG and RECIPES) on the phases already done (dry run 2026-12-05f: `ref_04: already done`, then
    v31 / lk / ep16 training on the plan's data)."""
    w = tmp_path / "w"
    first = {
        "W": str(w),
        "INIT": str(tmp_path / "missing"),
        "RECIPES": "mine:train.lr=2e-3",
        "NPROMPTS": "8",
    }
    r = _driver("start", first)
    assert r.returncode == 1 and "no exported drafter there" in r.stdout, (r.stdout, r.stderr)
    # the restart: nothing but W (PYTHON=false: had the settings been lost, the defaults' preflight fails, no launch)
    r = _driver("start", {"W": str(w), "PYTHON": "false"})
    assert r.returncode == 1 and not (w / "run.pid").exists(), (r.stdout, r.stderr)
    assert r.stdout.splitlines()[0] == (
        f"== settings of the earlier start kept (from {w}/driver.env): NPROMPTS INIT RECIPES"
    )
    assert (
        r.stdout.splitlines()[1]
        == f"== INIT={tmp_path}/missing: no exported drafter there (config.json + "
        "model.safetensors, or drafter.tar.gz.partNN)"
    )
    env_file = (w / "driver.env").read_text()
    assert "RECIPES=mine:train.lr=2e-3" in env_file and "PYTHON=false" in env_file
    # kept values are exported (the driver `start` launches reads its environment); a value given again wins
    probe = (
        '. bench/lease_lib.sh; lease_start_settings "$1" NPROMPTS RECIPES >/dev/null; '
        'bash -c \'printf "%s|%s" "$NPROMPTS" "$RECIPES"\''
    )
    got = subprocess.run(
        ["bash", "-c", probe, "x", str(w)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={"PATH": os.environ["PATH"], "NPROMPTS": "16"},
    )
    assert got.returncode == 0 and got.stdout == "16|mine:train.lr=2e-3", (got.stdout, got.stderr)


def test_settings_file_written_when_the_last_setting_is_unset(tmp_path):
    """driver.env is renamed into place whatever the last variable's state (lease 2026-12-05b: an unset last
    variable, PYTHON, left only driver.env.tmp, and `pack` knew no PACK_DRAFTER)."""
    w = tmp_path / "w"
    probe = (
        '. bench/lease_lib.sh; A="x y"; unset B; lease_save_settings "$1" A B; unset A; '
        'lease_load_settings "$1"; printf "%s" "$A"'
    )
    r = subprocess.run(
        ["bash", "-c", probe, "x", str(w)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={"PATH": os.environ["PATH"]},
    )
    assert r.returncode == 0 and r.stdout == "x y", (r.stdout, r.stderr)
    assert sorted(p.name for p in w.iterdir()) == ["driver.env"]


def test_start_refuses_while_a_driver_runs_and_clears_a_finished_ones_mark(tmp_path):
    """`start` with a live driver (run.pid) is refused in one line, nothing launched; a finished driver's ALL.done
    is removed before the new driver starts, so `wait` waits for the new one."""
    w = tmp_path / "w"
    (w / "status").mkdir(parents=True)
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        (w / "run.pid").write_text(f"{sleeper.pid}\n")
        (w / "status" / "ALL.done").write_text("")
        probe = '. bench/lease_lib.sh; lease_start "$1" /bin/false'
        r = subprocess.run(
            ["bash", "-c", probe, "x", str(w)], cwd=ROOT, capture_output=True, text=True
        )
        assert r.returncode == 1 and r.stderr.strip() == (
            f"error: a driver is still running (pid {sleeper.pid}, log {w}/run.log): `wait` for it, or `stop` it first"
        )
        assert (w / "status" / "ALL.done").exists() and not (w / "run.log").exists()
    finally:
        sleeper.kill()
        sleeper.wait()
    script = tmp_path / "drv.sh"
    script.write_text('[ "$1" = run ] && echo ran\n')
    r = subprocess.run(
        ["bash", "-c", '. bench/lease_lib.sh; lease_start "$1" "$2"', "x", str(w), str(script)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0 and r.stdout.startswith("started (pid "), r.stderr
    assert not (w / "status" / "ALL.done").exists() and (w / "run.log").read_text() == "ran\n"


@pytest.mark.parametrize("nprompts", ["40", "auto"])
def test_preflight_refuses_a_recipe_before_the_driver_starts(tmp_path, nprompts):
    """`start` loads every recipe's config: a bad --set is refused in one line naming the recipe, nothing launched
    (NPROMPTS=auto, sized at run time, passes the check: the first recipe is accepted)."""
    w = tmp_path / "w"
    r = _driver(
        "start",
        {
            "W": str(w),
            "RECIPES": "ref: bad:train.epochs=0",
            "CONFIG": "configs/tiny-llama.yaml",
            "NPROMPTS": nprompts,
            "SPEED": "1" if nprompts == "auto" else "0",
        },
    )  # (auto: regen_speed)
    assert r.returncode == 1 and not (w / "run.pid").exists(), (r.stdout, r.stderr)
    assert r.stderr.strip().startswith("error: recipe bad: ") and "train.epochs" in r.stderr, (
        r.stderr
    )


def _functions(*names: str) -> str:
    """The bash source of quality_session.sh's functions ``names`` (each from its ``name() {`` line to its ``}``)."""
    out = []
    for name in names:
        fn = subprocess.run(
            ["sed", "-n", f"/^{name}()/,/^}}/p", str(SCRIPT)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert fn.startswith(f"{name}()"), name
        out.append(fn)
    return "\n".join(out)


def test_lease_cached_recomputes_only_when_its_inputs_change(tmp_path):
    f = tmp_path / "v"
    probe = (
        '. bench/lease_lib.sh; n=$(cat "$2" 2>/dev/null || echo 0); '
        'lease_cached "$1" "$3" bash -c "echo computed; echo $((n + 1)) > $2"'
    )
    calls = tmp_path / "calls"

    def cached(inputs: str) -> str:
        r = subprocess.run(
            ["bash", "-c", probe, "x", str(f), str(calls), inputs],
            cwd=ROOT,
            capture_output=True,
            text=True,
            env={"PATH": os.environ["PATH"]},
        )
        assert r.returncode == 0, r.stderr
        return r.stdout

    assert cached("a=1 b=2") == "computed\n" and calls.read_text() == "1\n"
    assert (tmp_path / "v.inputs").read_text() == "a=1 b=2\n"
    f.write_text("kept\n")
    assert (
        cached("a=1 b=2") == "kept\n" and calls.read_text() == "1\n"
    )  # same inputs: the value kept, no call
    assert (
        cached("a=1 b=3") == "computed\n" and calls.read_text() == "2\n"
    )  # an input changed: computed again
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calls", "v", "v.inputs"]


def test_restarted_driver_recomputes_main_steps_when_its_inputs_change(tmp_path):
    """@MAIN_STEPS@ ($W/main_steps) is computed again when what it was computed from changed (STEPS_FOR_S, the
    measured online tokens/s, SPEED), not only when the file is removed by hand, and kept while those hold."""
    w = tmp_path / "w"
    (w / "speed").mkdir(parents=True)
    (w / "t0").write_text(f"{int(time.time())}\n")
    src = _functions("main_steps_inputs", "main_steps_compute", "main_steps")

    def steps(**env: str) -> int:
        r = subprocess.run(
            ["bash", "-c", f". bench/lease_lib.sh\n{src}\nmain_steps"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            env={"PATH": os.environ["PATH"], "W": str(w), "PY": sys.executable, **env},
        )
        assert r.returncode == 0, r.stderr
        return int(r.stdout)

    lease = {"SPEED": "1", "ONLINE_SPEED": "0", "ONLINE_TPS": "15000"}
    assert (
        steps(**lease, STEPS_FOR_S="300") == 300
    )  # 300 s x 15,000 tokens/s / 15,000 tokens a step
    (w / "main_steps").write_text("777\n")  # (a stand-in for a value the same inputs gave earlier)
    assert steps(**lease, STEPS_FOR_S="300") == 777  # a restart with the same inputs keeps it
    assert steps(**lease, STEPS_FOR_S="400") == 400  # another STEPS_FOR_S: computed again
    # SPEED=1 with the measured online figure; a new measurement is another input
    measured = {"SPEED": "1", "STEPS_FOR_S": "100"}
    (w / "speed" / "online_train_speed.json").write_text(
        json.dumps({"results": [{"mode": "online", "tokens_per_s": 30000}]})
    )
    assert steps(**measured) == 200
    (w / "speed" / "online_train_speed.json").write_text(
        json.dumps({"results": [{"mode": "online", "tokens_per_s": 45000}]})
    )
    assert steps(**measured) == 300
    assert (
        steps() == 1000
    )  # a driver without SPEED=1: unmeasured, the default (it used to take the stale 300)
    assert (w / "main_steps.inputs").read_text() == "unmeasured\n"


def _self_instruct_driver(tmp_path, w, calls, steps: str, env: dict) -> subprocess.CompletedProcess:
    """The driver's seed / self-instruct functions run as ``steps`` (bash) with ``env``, its $PY a fake 01 that records
    its arguments in ``calls`` and writes ``--out`` + its report (self-instruct mode) or prompts.jsonl + report under
    ``output_root`` (a normal run)."""
    fake = tmp_path / "fakepy"
    fake.write_text(
        f'#!/usr/bin/env bash\necho "$*" >> "{calls}"\nout=; root=\n'
        'while [ $# -gt 0 ]; do [ "$1" = --out ] && out=$2; case "$2" in output_root=*) root=${2#*=};; esac;'
        " shift; done\n"
        'if [ -n "$out" ]; then echo \'{"id": "self_instruct/0"}\' > "$out"; echo "{}" > "${out%.jsonl}_report.json"\n'
        'else mkdir -p "$root"; echo \'{"id": "s0"}\' > "$root/prompts.jsonl"; echo \'{"r": 1}\' > "$root/prompts_report.json"; fi\n'
    )
    fake.chmod(0o755)
    src = _functions("phase", "seed_prompts", "self_instruct_prompts", "self_instruct_base")
    script = (
        f'{src}\nW="{w}"; ROOT="$W/data-run"; PY="{fake}"; CONFIG=c.yaml; NPROMPTS=4000\n'
        f"BASE=(--set verifier.path=v); self_instruct_base\n{steps}"
    )
    return subprocess.run(
        ["bash", "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": os.environ["PATH"], **env},
    )


def test_self_instruct_adds_the_verifiers_prompts_to_the_seed(tmp_path):
    """SELF_INSTRUCT=N: the seed goes to $W/seed (a source of 01, not its output), 01 --self-instruct N writes
    $W/self_instruct.jsonl with every SI_EXCLUDE file excluded (once: a done phase is skipped), the file and its report
    go to speed/ for the tarball, and every stage's --set list reads both files with the seed as prompts.reuse_answers
    and no sample size; without SEED the phase refuses."""
    w, seed = tmp_path / "w", tmp_path / "seed"
    for d in ("status", "logs", "speed"):
        (w / d).mkdir(parents=True)
    seed.mkdir()
    (seed / "prompts.jsonl.gz").write_bytes(gzip.compress(b'{"id": "c0", "messages": []}\n'))
    (seed / "prompts_report.json").write_text("{}")
    calls = tmp_path / "calls"
    r = _self_instruct_driver(
        tmp_path,
        w,
        calls,
        "seed_prompts && self_instruct_prompts && self_instruct_prompts && "
        'printf "%s\\n" "${BASE[@]}" "N=$NPROMPTS"',
        {"SEED": str(seed), "SELF_INSTRUCT": "5", "SI_EXCLUDE": "e1.jsonl e2.jsonl"},
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert (w / "seed" / "prompts.jsonl").read_text() == '{"id": "c0", "messages": []}\n'
    assert not (w / "data-run" / "prompts.jsonl").exists()
    sets = (
        f"--set verifier.path=v --set prompts.source=[{w}/seed/prompts.jsonl,{w}/self_instruct.jsonl] "
        f"--set prompts.sample_size=null --set prompts.reuse_answers={w}/seed/prompts.jsonl"
    )
    assert calls.read_text().splitlines() == [  # one call: the second found the phase done
        f"01_prepare_prompts.py --config c.yaml {sets} --self-instruct 5 --out {w}/self_instruct.jsonl "
        "--exclude e1.jsonl --exclude e2.jsonl"
    ]
    assert (
        gzip.decompress((w / "speed" / "self_instruct.jsonl.gz").read_bytes())
        == b'{"id": "self_instruct/0"}\n'
    )
    assert (w / "speed" / "self_instruct_report.json").exists()
    assert r.stdout.splitlines()[-9:] == sets.split(" ") + [
        "N="
    ]  # every stage's --set list; NPROMPTS dropped
    r = _self_instruct_driver(tmp_path, w, calls, "self_instruct_prompts", {"SELF_INSTRUCT": "5"})
    assert r.returncode == 1 and "SELF_INSTRUCT needs SEED or SEED_NPROMPTS" in r.stdout


def test_seed_nprompts_makes_the_seed_before_the_self_instruct_prompts(tmp_path):
    """SELF_INSTRUCT without SEED but with SEED_NPROMPTS=M: phase seed01 runs 01 on the config's own sources (the
    --set list before self_instruct_base added the seed + self-instruct files) with prompts.sample_size=M into
    $W/seed-run; that folder becomes SEED, copied to $W/seed; a second call skips the done phase."""
    w = tmp_path / "w"
    for d in ("status", "logs", "speed"):
        (w / d).mkdir(parents=True)
    calls = tmp_path / "calls"
    r = _self_instruct_driver(
        tmp_path,
        w,
        calls,
        'seed_prompts && self_instruct_prompts && SEED= && seed_prompts && echo "SEED=$SEED"',
        {"SEED_NPROMPTS": "7", "SELF_INSTRUCT": "5"},
    )
    assert r.returncode == 0, r.stdout + r.stderr
    lines = calls.read_text().splitlines()
    assert lines[0] == (
        f"01_prepare_prompts.py --config c.yaml --set verifier.path=v --set output_root={w}/seed-run "
        "--set prompts.sample_size=7"
    )
    assert (
        len(lines) == 2 and "--self-instruct 5" in lines[1]
    )  # the repeated seed_prompts found seed01 done
    assert (w / "seed" / "prompts.jsonl").read_text() == '{"id": "s0"}\n'
    assert (w / "seed" / "prompts_report.json").read_text() == '{"r": 1}\n'
    assert r.stdout.splitlines()[-1] == f"SEED={w}/seed-run"


@pytest.mark.parametrize("extra", [{}, {"SELF_INSTRUCT": "10", "SEED": "/nonexistent-seed"}])
def test_start_refuses_seed_nprompts_it_would_ignore(tmp_path, extra):
    """Lease 2026-12-05f: SEED_NPROMPTS=100000 without SELF_INSTRUCT (meant as the data set's size) was ignored and the
    driver trained on NPROMPTS' default 4,000 conversations; `start` now refuses it in one line naming NPROMPTS."""
    w = tmp_path / "w"
    r = _driver(
        "start",
        {
            "W": str(w),
            "RECIPES": "ref:",
            "CONFIG": "configs/tiny-llama.yaml",
            "SEED_NPROMPTS": "100000",
            **extra,
        },
    )
    assert r.returncode == 1 and not (w / "run.pid").exists(), (r.stdout, r.stderr)
    assert r.stderr.strip() == (
        "error: SEED_NPROMPTS=100000 is read only with SELF_INSTRUCT > 0 and no SEED (it sizes the seed the "
        "self-instruct prompts add to); for the data set's size set NPROMPTS=100000"
    ), r.stderr


def test_preflight_checks_the_benchmarks_set_list(tmp_path):
    """Lease 2026-12-05f: BENCH_SETS=mtbench (not a section.key=value) failed every 05 after its training; `start`
    checks 05's --set list with the recipes'."""
    w = tmp_path / "w"
    r = _driver(
        "start",
        {
            "W": str(w),
            "RECIPES": "ref:",
            "CONFIG": "configs/tiny-llama.yaml",
            "BENCH_SETS": "mtbench",
        },
    )
    assert r.returncode == 1 and not (w / "run.pid").exists(), (r.stdout, r.stderr)
    assert r.stdout.splitlines()[-1] == "preflight ref: ok", r.stdout
    assert (
        r.stderr.strip().startswith("error: recipe 05 (BENCH_SETS): ") and "mtbench" in r.stderr
    ), r.stderr


@pytest.mark.parametrize("phase", ["04", "05s3", "05s7"])
def test_out_of_memory_retry_waits_for_the_other_trainings(tmp_path, phase):
    """Lease 2026-12-05f (H100): two chains that ran out of memory beside a third training retried 20 s later, beside
    it again, and failed again. The retry of an out-of-memory 04 now starts once no other recipe's 04 runs (its own
    pid file does not count); so does that of a chain whose 05 ran out of memory (only its 04's log was read)."""
    w = tmp_path / "w"
    (w / "status").mkdir(parents=True)
    (w / "logs").mkdir()
    (w / "logs" / f"big_{phase}.log").write_text(
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 6.73 GiB.\n"
    )
    script = (
        _functions("retry_wait", "other_trainings")
        + """
sleep 1.5 & other=$!
echo "$other" > "$W/status/ref_04.pid"
sleep 30 & own=$!
echo "$own" > "$W/status/big_04.pid"
retry_wait big
if kill -0 "$other" 2>/dev/null; then echo "retried while ref trains"; else echo "retried after ref"; fi
kill "$own"
"""
    )
    r = subprocess.run(
        ["bash", "-c", script],
        env={**os.environ, "W": str(w), "RETRY_POLL_S": "0.2"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.stdout.splitlines() == [
        "== big: out of memory; its retry waits until no other training runs",
        "retried after ref",
    ], (r.stdout, r.stderr)


@pytest.mark.parametrize("setting", ["BENCH_FULL", "SPEED05", "PACK_DRAFTER"])
def test_start_refuses_a_setting_naming_no_recipe(tmp_path, setting):
    """BENCH_FULL / SPEED05 / PACK_DRAFTER name recipes; a name that is none was ignored in silence (lease-next.env's
    BENCH_FULL named b64k, dropped from its RECIPES, and not warm10, which then got 05 on MT-bench at 3 steps only)."""
    w = tmp_path / "w"
    value = "ref b64k" if setting == "BENCH_FULL" else "b64k"
    r = _driver(
        "start",
        {
            "W": str(w),
            "RECIPES": "ref: lr2e-3:train.lr=2e-3",
            "CONFIG": "configs/tiny-llama.yaml",
            setting: value,
            "PYTHON": "false",
        },
    )  # (false: a start that passed would launch nothing)
    assert r.returncode == 1 and not (w / "run.pid").exists(), (r.stdout, r.stderr)
    assert (
        r.stderr.strip()
        == f"error: {setting} names b64k, which is no recipe of RECIPES (ref lr2e-3): it would be ignored"
    )


def test_the_next_leases_plan_passes_the_settings_check(tmp_path):
    """bench/plans/lease-next.env as the lease sources it (set -a): check_settings accepts it, every recipe of its
    RECIPES gets the full benchmark (its comments: 05 on the three sets at 3 steps and MT-bench at 7 for each run).
    W is a fresh folder: the plan's own W may hold a lease's run (its clock, ``$W/t0``) on the machine testing."""
    script = (
        f"set -a; . bench/plans/lease-next.env; W={tmp_path / 'w'}; set +a\n{_functions('check_settings')}\n"
        "check_settings && "
        'for spec in $RECIPES; do n=${spec%%:*}; [[ " $BENCH_FULL " == *" $n "* ]] && echo "$n full"; done'
    )
    r = subprocess.run(
        ["bash", "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": os.environ["PATH"]},
    )
    assert r.returncode == 0, r.stderr
    recipes = re.search(
        r'^RECIPES="([^"]*)"', (ROOT / "bench/plans/lease-next.env").read_text(), re.M
    ).group(1)
    names = [spec.split(":", 1)[0] for spec in recipes.split()]
    assert len(names) >= 2 and r.stdout.splitlines() == [f"{n} full" for n in names]


def _env(path) -> dict:
    """The ``KEY=value`` lines of a plan file as bash reads them (quotes removed)."""
    r = subprocess.run(
        ["bash", "-c", f"set -a; . {path}; set +a; env -0"],
        capture_output=True,
        timeout=30,
        env={"PATH": os.environ["PATH"]},
        check=True,
    )
    return dict(x.split("=", 1) for x in r.stdout.decode().split("\0") if "=" in x)


def test_the_long_context_plans_differ_only_in_the_samples_and_pass_the_settings_check(tmp_path):
    """bench/plans/long-context-{short,long}.env: each passes check_settings on a fresh W; the two differ only in
    their W, recipe name and the RUN_SETS that make long samples (chain_conversations, the context cap, max_length,
    the regeneration rows that fit): same conversations, recipe, steps and 05."""
    plans = {e: ROOT / f"bench/plans/long-context-{e}.env" for e in ("short", "long")}
    for e, path in plans.items():
        script = f"set -a; . {path}; W={tmp_path / e}; set +a\n{_functions('check_settings')}\ncheck_settings"
        r = subprocess.run(
            ["bash", "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60,
            env={"PATH": os.environ["PATH"]},
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
    short, long = (_env(p) for p in plans.values())
    keys = {k for p in plans.values() for k in re.findall(r"^([A-Z0-9_]+)=", p.read_text(), re.M)}
    differ = {k for k in keys if short.get(k) != long.get(k)}
    assert differ == {"W", "RECIPES", "BENCH_FULL", "RUN_SETS"}
    assert short["RECIPES"].replace("short:", "long:") == long["RECIPES"]
    sets = dict(x.split("=", 1) for x in long["RUN_SETS"].split())
    assert int(sets["prompts.chain_conversations"]) > 1
    assert int(sets["prompts.max_context_tokens"]) < int(sets["extract.max_length"]) <= 8192
    assert "benchmark.context_lengths=" in short["BENCH_SETS"]


def test_wait_returns_when_the_driver_is_gone(tmp_path):
    """`wait N` waited for ALL.done only: a driver that died (stopped, killed, an error) without it cost the whole N
    seconds of device time. It now returns once the driver `start` launched is gone, says so in one line, and packs."""
    w, out = tmp_path / "w", tmp_path / "out"
    (w / "status").mkdir(parents=True)
    out.mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()
    (w / "run.pid").write_text(f"{dead.pid}\n")
    (w / "run.log").write_text("== ref_04: start 10:00:00\n")
    t0 = time.monotonic()
    r = subprocess.run(
        ["bash", str(SCRIPT), "wait", "120"],
        capture_output=True,
        text=True,
        timeout=200,
        env={"PATH": os.environ["PATH"], "PYTHON": sys.executable, "W": str(w), "OUT": str(out)},
    )
    assert r.returncode == 0, r.stderr
    assert time.monotonic() - t0 < 60
    assert r.stdout.splitlines()[0] == (
        f"== the driver is not running and did not finish (no {w}/status/ALL.done; "
        f"see {w}/run.log): packing what is there"
    )
    assert sorted(p.name for p in out.iterdir()) == ["quality-results.tar.gz"]


def test_each_run_records_its_set_list_and_the_summary_reports_it(tmp_path):
    """Every run's quality.json (the headline's too, what bench/results/quality.json should hold) said "overrides": []
    of drafters trained with a dozen --set values (the plan's drafter.num_layers=1, max_steps, lr, ...): the pack held
    no record of them. recipe_chain writes the run's whole --set list to runs/NAME/overrides.txt (a comma inside
    brackets kept), `pack` brings it back, quality_recipes records it."""
    w = tmp_path / "w"
    for d in ("status", "logs"):
        (w / d).mkdir(parents=True)
    fake = tmp_path / "fakepy"
    fake.write_text("#!/usr/bin/env bash\nexit 0\n")
    fake.chmod(0o755)
    src = _functions("phase", "rargs", "recipe_chain", "train_until_deadline")
    script = (
        f'{src}\nW="{w}"; ROOT="$W/data-run"; PY="{fake}"; CONFIG=c.yaml; NPROMPTS=8; SETS7=; B5=(); '
        "BASE=(--set verifier.path=v --set train.hidden_states=online); CM=(train.eval_every=50)\n"
        'recipe_chain lr "train.lr=2e-3,data.exclude_id_prefixes=[a/,b/]"'
    )
    r = subprocess.run(
        ["bash", "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": os.environ["PATH"]},
    )
    assert r.returncode == 0, r.stdout + r.stderr
    lines = (w / "runs" / "lr" / "overrides.txt").read_text().splitlines()
    data = (w / "runs" / "lr" / "data_dir").read_text().strip()
    assert lines == [
        "verifier.path=v",
        "train.hidden_states=online",
        f"output_root={w}/runs/lr",
        f"extract.output_dir={w}/data-run/shards",
        f"data.output_dir={data}",
        "prompts.sample_size=8",
        "train.eval_every=50",
        "train.lr=2e-3",
        "data.exclude_id_prefixes=[a/,b/]",
    ]
    r = _driver("pack", {"W": str(w)})
    assert r.returncode == 0, r.stderr
    assert (w / "res" / "runs" / "lr" / "overrides.txt").read_text().splitlines() == lines
    # quality_recipes: the list into the run's quality.json
    sys.path.insert(0, str(ROOT / "bench"))
    import quality_recipes as qr

    runs = tmp_path / "runs"
    for name in ("ref", "lr"):
        (runs / name).mkdir(parents=True)
        ds = {
            "dataset": "mtbench",
            "num_prompts": 1,
            "tau": 2.0,
            "conditional": [0.5] * 3,
            "unconditional": [0.5] * 3,
            "batch_size": 1,
            "speedup": 1.0,
            "drafter_share": 0.1,
            "wall_seconds": 1.0,
            "failures": 0,
            "near_ties": 0,
        }
        (runs / name / "bench-steps3.json").write_text(json.dumps({"steps": 3, "datasets": [ds]}))
    (runs / "lr" / "overrides.txt").write_text("\n".join(lines) + "\n")
    qr.summarise(runs, "ref", tmp_path / "out")
    assert json.loads((tmp_path / "out" / "lr" / "quality.json").read_text())["overrides"] == lines
    assert json.loads((tmp_path / "out" / "ref" / "quality.json").read_text())["overrides"] == []


@pytest.mark.parametrize(
    "setting,value",
    [
        ("SETS7", "mtbench mt-bench"),
        ("BENCH_ABL", "mt-bench"),
        ("SPEED05_SETS", "mtbench:batched mt-bench:static"),
    ],
)
def test_start_refuses_an_evaluation_set_05_does_not_know(tmp_path, setting, value):
    """SETS7 / BENCH_ABL / SPEED05_SETS name 05's evaluation sets; a typo failed only in 05, after the training (as
    BENCH_SETS=mtbench did in lease 2026-12-05f). `start` refuses it in one line; a prompt file passes."""
    w = tmp_path / "w"
    env = {
        "W": str(w),
        "RECIPES": "ref:",
        "CONFIG": "configs/tiny-llama.yaml",
        "PYTHON": "false",
        setting: value,
    }
    r = _driver("start", env)
    assert r.returncode == 1 and not (w / "run.pid").exists(), (r.stdout, r.stderr)
    assert r.stderr.strip() == (
        f"error: {setting} names the evaluation set mt-bench: neither mtbench, humaneval, "
        "gsm8k nor a prompt file"
    )
    prompts = tmp_path / "mine.jsonl"
    prompts.write_text('{"id": "a", "prompt": "hi"}\n')
    r = _driver("start", {**env, setting: value.replace("mt-bench", str(prompts))})
    # past the check, to the preflight (PYTHON=false: it fails there in silence, nothing launched)
    assert r.returncode == 1 and r.stderr == "" and not (w / "run.pid").exists(), (
        r.stdout,
        r.stderr,
    )


def test_the_results_tarball_holds_the_drivers_settings(tmp_path):
    """The settings a lease's driver ran with (TRAIN_END_S and the others given at the call) came back in no file: the
    tarball now holds $W/driver.env as res/driver.env."""
    import tarfile

    w, out = tmp_path / "w", tmp_path / "out"
    r = _driver(
        "start",
        {"W": str(w), "INIT": str(tmp_path / "missing"), "TRAIN_END_S": "1234", "RECIPES": "ref:"},
    )
    assert r.returncode == 1, (r.stdout, r.stderr)
    _after_01(w)
    out.mkdir()
    r = _driver("pack", {"W": str(w), "OUT": str(out)})
    assert r.returncode == 0, r.stderr
    with tarfile.open(out / "quality-results.tar.gz") as t:
        got = t.extractfile("res/driver.env").read().decode()
    assert (
        got == (w / "driver.env").read_text()
        and '[ -n "${TRAIN_END_S:-}" ] || TRAIN_END_S=1234\n' in got
    )


@pytest.mark.parametrize(
    "env,line",
    [
        (
            {"NPROMPTS": "auto"},
            "error: NPROMPTS=auto sizes 01 from bench/regen_speed.py's rate: it needs SPEED=1 and "
            "REGEN_SPEED=1 (SPEED=0 REGEN_SPEED=1); else set NPROMPTS to a number",
        ),
        (
            {"NPROMPTS": "auto", "SPEED": "1", "REGEN_SPEED": "0"},
            "error: NPROMPTS=auto sizes 01 from "
            "bench/regen_speed.py's rate: it needs SPEED=1 and REGEN_SPEED=1 (SPEED=1 REGEN_SPEED=0); else set NPROMPTS to "
            "a number",
        ),
        (
            {"REGEN_COMPILE": "auto", "SPEED": "1", "REGEN_STEP": "0"},
            "error: REGEN_COMPILE=auto decides from "
            "bench/regen_step.py: it needs SPEED=1 and REGEN_STEP=1 (SPEED=1 REGEN_STEP=0); else set REGEN_COMPILE to 0 or 1",
        ),
        ({"REGEN_COMPILE": "true"}, "error: REGEN_COMPILE=true: expected 0, 1 or auto"),
    ],
)
def test_start_refuses_settings_their_benches_would_not_feed(tmp_path, env, line):
    """NPROMPTS=auto without regen_speed (SPEED=0 or REGEN_SPEED=0) fell back to 20,000 conversations; REGEN_COMPILE=auto
    without regen_step (SPEED=0 or REGEN_STEP=0) to the config's own regen_compile, and REGEN_COMPILE=true (not 1)
    did nothing: each in silence. `start` refuses them in one line."""
    w = tmp_path / "w"
    r = _driver(
        "start",
        {
            "W": str(w),
            "RECIPES": "ref:",
            "CONFIG": "configs/tiny-llama.yaml",
            "PYTHON": "false",
            **env,
        },
    )
    assert r.returncode == 1 and not (w / "run.pid").exists(), (r.stdout, r.stderr)
    assert r.stderr.strip() == line


@pytest.mark.parametrize("limit", [{"OUT_MAX_FILES": "2"}, {"OUT_MAX_BYTES": str(2**20)}])
def test_prompts_come_back_whole_or_not_at_all_within_out(tmp_path, limit):
    """$OUT takes 8 files and 64 MiB together, the results tarball included; the prompt parts were sent when under
    PARTS_MAX x 15 MiB (75 MiB by default), so parts over the total could be left out by the machine and the seed
    come back incomplete. They are now sent only when all of them and their report fit beside the tarball (here the
    limits are lowered: 2 files, or 1 MiB beside ~1.6 MiB of prompts)."""
    w, out = tmp_path / "w", tmp_path / "out"
    _after_01(w)
    (w / "status" / "ALL.done").touch()
    if "OUT_MAX_BYTES" in limit:  # ~1.6 MiB gzipped (random hex answers)
        rows = [
            {
                "id": f"c{i}",
                "messages": [
                    {"role": "user", "content": "q"},
                    {"role": "assistant", "content": os.urandom(3000).hex()},
                ],
            }
            for i in range(520)
        ]
        (w / "data-run" / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in rows))
    out.mkdir()
    r = _driver("pack", {"W": str(w), "OUT": str(out), **limit})
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in out.iterdir()) == ["quality-results.tar.gz"]
    size = (w / "prompts.jsonl.gz").stat().st_size
    line = next(x for x in r.stdout.splitlines() if x.startswith("== prompts:"))
    assert line.startswith(
        f"== prompts: {size} bytes gzipped (1 parts) do not fit $OUT beside the results ("
    )
    assert line.endswith(" files left): left behind")
    out2 = tmp_path / "out2"  # the default limits: they come back
    out2.mkdir()
    r = _driver("pack", {"W": str(w), "OUT": str(out2)})
    assert sorted(p.name for p in out2.iterdir()) == [
        "prompts.jsonl.gz.part00",
        "prompts_report.json",
        "quality-results.tar.gz",
    ]


def test_a_setting_given_empty_holds_for_the_later_verbs_and_a_restart(tmp_path):
    """SETS7= (no 7-step run), BENCH_SETS= (no --set for 05), NPROMPTS= (every conversation) mean something empty;
    driver.env recorded only non-empty values, so a restart (or a later verb) took the defaults instead: 7-step runs
    the plan did not budget, an fp32 05 for the restarted chains beside the others' bf16. They are recorded empty."""
    w = tmp_path / "w"
    r = _driver(
        "start",
        {
            "W": str(w),
            "INIT": str(tmp_path / "missing"),
            "RECIPES": "ref:",
            "SETS7": "",
            "BENCH_SETS": "",
            "NPROMPTS": "",
        },
    )
    assert r.returncode == 1 and "no exported drafter there" in r.stdout, (r.stdout, r.stderr)
    env_file = (w / "driver.env").read_text()
    assert "[ -n \"${SETS7:-}\" ] || SETS7=''\n" in env_file and "BENCH_SETS=''" in env_file
    r = _driver("start", {"W": str(w), "PYTHON": "false"})  # the restart: nothing given
    assert r.stdout.splitlines()[0] == (
        f"== settings of the earlier start kept (from {w}/driver.env): NPROMPTS= "
        "INIT RECIPES BENCH_SETS= SETS7="
    )
    probe = (
        '. bench/lease_lib.sh; lease_start_settings "$1" SETS7 BENCH_SETS >/dev/null; '
        'bash -c \'printf "%s|%s" "${SETS7-unset}" "${BENCH_SETS-unset}"\''
    )
    got = subprocess.run(
        ["bash", "-c", probe, "x", str(w)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={"PATH": os.environ["PATH"]},
    )
    assert got.returncode == 0 and got.stdout == "|", (
        got.stdout,
        got.stderr,
    )  # set and empty in the driver


def test_start_refuses_a_train_end_that_has_passed(tmp_path):
    """TRAIN_END_S counts from the W's first start ($W/t0, kept by a restart). A later start on the same W whose
    deadline had passed (lease 2026-12-05f's call 5: a fourth recipe, TRAIN_END_S from call 4 long past) would have
    every 04 only export a checkpoint it does not have; `start` refuses it in one line saying how to go on."""
    w = tmp_path / "w"
    (w / "status").mkdir(parents=True)
    (w / "t0").write_text(f"{int(time.time()) - 2000}\n")
    env = {"W": str(w), "RECIPES": "ref:", "CONFIG": "configs/tiny-llama.yaml", "PYTHON": "false"}
    r = _driver("start", {**env, "TRAIN_END_S": "1500"})
    assert r.returncode == 1 and not (w / "run.pid").exists(), (r.stdout, r.stderr)
    err = r.stderr.strip()
    assert err.startswith(
        f"error: TRAIN_END_S=1500 has passed: it counts from this W's first start ({w}/t0), 20"
    ), err
    assert err.endswith(f" s more) or start the clock again (rm {w}/t0)"), err
    r = _driver(
        "start", {**env, "TRAIN_END_S": "3000"}
    )  # still ahead: past the check (to the preflight)
    assert r.returncode == 1 and r.stderr == "", r.stderr
