"""torchrun regeneration: 2 gloo ranks on CPU write the prompts.jsonl of a one-process run (fp32 tiny verifier)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3.chat.template import ANSWER_FIELDS
from eagle3.regen.replicas import all_logs, assemble, log_path, merge_stats, share

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from _paths import child_env
from _signals import lines_settled, sigterm_when  # noqa: E402


def _conv(cid, n_turns, tools=False):
    msgs = []
    for t in range(n_turns):
        msgs += [
            {
                "role": "user",
                "content": f"Conversation {cid}, question {t + 1}: how many legs has a {t + 2}-pod?",
            },
            {"role": "assistant", "content": "old"},
        ]
    if tools:
        msgs += [{"role": "tool", "content": "42"}]
    return {"id": cid, "messages": msgs}


def _setup(tmp_path: Path, tiny_llama_dir: Path, name: str, engine: str = "slots") -> Path:
    src = tmp_path / "convs.jsonl"
    if not src.exists():
        convs = [_conv(f"c{i}", n) for i, n in enumerate([1, 3, 1, 2, 4, 1, 1])]
        src.write_text("".join(json.dumps(c) + "\n" for c in convs))
    cfg = tmp_path / f"{name}.yaml"
    cfg.write_text(f"""run_name: {name}
output_root: {tmp_path / name}
verifier: {{path: {tiny_llama_dir}, dtype: float32, device: cpu}}
prompts: {{source: {src}, format: messages, regenerate: true, max_new_tokens: 6, gen_batch_size: 2,
          regen_engine: {engine}, regen_check_every: 2}}
extract: {{max_length: 256}}
""")
    return cfg


def _run01(cfg: Path, nproc: int, *extra) -> subprocess.CompletedProcess:
    env = child_env(ROOT)
    launch = (
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            str(nproc),
        ]
        if nproc > 1
        else [sys.executable]
    )
    p = subprocess.run(
        [*launch, str(ROOT / "01_prepare_prompts.py"), "--config", str(cfg), *extra],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return p


@pytest.mark.slow
def test_two_gloo_ranks_write_the_one_process_file(tmp_path, tiny_llama_dir):
    one, two = _setup(tmp_path, tiny_llama_dir, "one"), _setup(tmp_path, tiny_llama_dir, "two")
    _run01(one, 1)
    _run01(two, 2)
    a = (tmp_path / "one" / "prompts.jsonl").read_text()
    b = (tmp_path / "two" / "prompts.jsonl").read_text()
    assert a == b and len(a.splitlines()) == 7
    rep = json.loads((tmp_path / "two" / "prompts_report.json").read_text())["regeneration"]
    assert rep["replicas"] == 2 and rep["answers"] == 13
    assert (
        json.loads((tmp_path / "one" / "prompts_report.json").read_text())["regeneration"][
            "answers"
        ]
        == 13
    )
    assert (
        all_logs(tmp_path / "two") == []
    )  # every replica's log removed once prompts.jsonl is written

    # resume across world sizes: a killed 2-rank run left rank 1's log with two conversations; one process
    # takes them from it, answers the rest and writes the same file
    three = _setup(tmp_path, tiny_llama_dir, "three")
    settings = json.loads((tmp_path / "one" / "prompts_report.json").read_text())["settings"]
    rows = [json.loads(x) for x in a.splitlines()]
    (tmp_path / "three").mkdir()
    log_path(tmp_path / "three", 1).write_text(
        json.dumps({"settings": settings, "answer_fields": list(ANSWER_FIELDS)})
        + "\n"
        + "".join(json.dumps({"idx": i, **rows[i]}) + "\n" for i in (1, 4))
    )
    _run01(three, 1)
    assert (tmp_path / "three" / "prompts.jsonl").read_text() == a
    rep = json.loads((tmp_path / "three" / "prompts_report.json").read_text())["regeneration"]
    assert rep["resumed"] == 2 and rep["answers"] == 13 - 3 - 4


def test_two_ranks_without_regeneration_write_once(tmp_path, tiny_llama_dir):
    """`torchrun --nproc_per_node 2 01_prepare_prompts.py` with prompts.regenerate: false: both ranks wrote
    prompts.jsonl and its report and printed the closing lines twice (fresh-user trial 2026-12-05f). Nothing is
    shared out without regeneration: rank 0 writes and prints, once; the file is the one-process run's."""
    one, two = _setup(tmp_path, tiny_llama_dir, "one"), _setup(tmp_path, tiny_llama_dir, "two")
    for p in (one, two):
        p.write_text(p.read_text().replace("regenerate: true", "regenerate: false"))
    _run01(one, 1)
    out = _run01(two, 2).stdout.splitlines()
    assert (tmp_path / "two" / "prompts.jsonl").read_text() == (
        tmp_path / "one" / "prompts.jsonl"
    ).read_text()
    assert [x for x in out if x.startswith("prompts: ")] == [
        f"prompts: {tmp_path / 'two' / 'prompts.jsonl'} (7 conversations; read 7, skipped 0, deduped 0, regenerated 0)"
    ]


def test_share_deals_multi_turn_conversations_round_robin():
    convs = [_conv(str(i), n) for i, n in enumerate([1, 3, 1, 2, 4, 1])]
    # by user turns: 4 (4), 1 (3), 3 (2), then 0, 2, 5 (1 each, by position); dealt 4, 1, 3, 0, 2, 5
    assert share(convs, list(range(6)), 0, 2) == [2, 3, 4]
    assert share(convs, list(range(6)), 1, 2) == [0, 1, 5]
    assert share(convs, [0, 2, 5], 0, 3) == [0] and share(convs, [0, 2, 5], 2, 3) == [5]
    assert sorted(share(convs, list(range(6)), 0, 1)) == list(range(6))


def test_assemble_and_merge_stats(tmp_path):
    convs = [_conv("a", 1), _conv("t", 1, tools=True), _conv("dropped", 1), _conv("b", 2)]
    fin = {0: {"id": "a", "messages": ["A"]}, 3: {"id": "b", "messages": ["B"]}}
    assert assemble(convs, fin, lambda c: c["id"] == "t") == [fin[0], convs[1], fin[3]]
    st = merge_stats(
        [
            {"answers": 3, "seconds": 2.0, "decode_steps": 10, "engine": "slots"},
            {"answers": 2, "seconds": 5.0, "decode_steps": 4},
        ],
        resumed=1,
        kept_with_tools=1,
    )
    assert (
        st["answers"] == 5
        and st["seconds"] == 5.0
        and st["decode_steps"] == 14
        and st["replicas"] == 2
    )
    assert st["resumed"] == 1 and st["engine"] == "slots"
    assert log_path(tmp_path, 0).name == "prompts.regen-partial.jsonl"
    for r in (2, 0, 11):
        log_path(tmp_path, r).write_text("x")
    assert [p.name for p in all_logs(tmp_path)] == [
        "prompts.regen-partial.jsonl",
        "prompts.regen-partial.rank2.jsonl",
        "prompts.regen-partial.rank11.jsonl",
    ]


@pytest.mark.slow
def test_sigterm_prints_the_resume_line_and_the_rerun_equals_the_uninterrupted_run(
    tmp_path, tiny_llama_dir
):
    """01 regenerating, SIGTERM once a conversation is in the resume log: exit 143 and one stderr line (how many
    were kept, re-run the same command), no traceback; the same command then writes the uninterrupted run's file."""

    src = tmp_path / "many.jsonl"
    src.write_text("".join(json.dumps(_conv(f"m{i}", 1 + i % 3)) + "\n" for i in range(40)))

    def cfg_for(name: str) -> Path:
        cfg = tmp_path / f"{name}.yaml"
        cfg.write_text(f"""run_name: {name}
output_root: {tmp_path / name}
verifier: {{path: {tiny_llama_dir}, dtype: float32, device: cpu}}
prompts: {{source: {src}, format: messages, regenerate: true, max_new_tokens: 24, gen_batch_size: 2,
          regen_check_every: 2}}
extract: {{max_length: 256}}
""")
        return cfg

    _run01(cfg_for("ref"), 1)
    cfg, out = cfg_for("cut"), tmp_path / "cut"
    partial = out / "prompts.regen-partial.jsonl"
    env = child_env(ROOT, TQDM_DISABLE="1")
    rc, err = sigterm_when(
        [sys.executable, str(ROOT / "01_prepare_prompts.py"), "--config", str(cfg)],
        env=env,
        cwd=ROOT,
        ready=lines_settled(partial, 2),
    )
    assert rc == 143, err[-3000:]  # SIGTERM once the settings line and a conversation are logged
    assert "Traceback" not in err, err[-3000:]
    logged = [
        json.loads(x) for x in partial.read_text().splitlines()[1:]
    ]  # after the settings line
    kept = len({r["idx"] for r in logged})  # distinct: an interrupted flush may log one twice
    assert 1 <= kept < 40 and not (out / "prompts.jsonl").exists()
    assert err.strip().splitlines()[-1] == (
        f"interrupted by SIGTERM: {kept} regenerated conversation{'' if kept == 1 else 's'} kept in {out / 'prompts.regen-partial*.jsonl'}; "
        "re-run the same command (without --force) to resume"
    ), err[-3000:]

    again = _run01(cfg, 1)
    assert (out / "prompts.jsonl").read_text() == (tmp_path / "ref" / "prompts.jsonl").read_text()
    rep = json.loads((out / "prompts_report.json").read_text())["regeneration"]
    assert rep["resumed"] == kept
    assert (
        f"resuming: {kept} of 40 conversations already regenerated (resume log), {40 - kept} to go"
        in again.stderr
    )


@pytest.mark.slow
def test_two_ranks_through_endpoints_or_without_regeneration_do_the_work_once(
    tmp_path, tiny_llama_dir
):
    """``torchrun --nproc_per_node 2 01`` with ``prompts.regenerate_via: openai`` (or no regeneration): only the
    in-process regeneration shares work over ranks, so rank 0 does it all and the other rank returns at once. Before,
    every rank sent every request (the stand-in server got each turn twice), appended to the same resume log and wrote
    prompts.jsonl, printing the closing lines once per rank."""
    sys.path.insert(0, str(ROOT / "tests" / "prompts"))
    from standin_server import FakeBackend, StandInServer
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    cfg = _setup(tmp_path, tiny_llama_dir, "srv")
    with StandInServer(FakeBackend(tok.eos_token_id), tok) as srv:
        p = _run01(
            cfg,
            2,
            "--set",
            "prompts.regenerate_via=openai",
            "--set",
            f"prompts.server.urls=[{srv.url}]",
        )
        n_requests = len(srv.requests)
    assert n_requests == 13  # one per user turn of the 7 conversations (1 + 3 + 1 + 2 + 4 + 1 + 1)
    assert (
        p.stdout.count("prompts: ") == 1
        and len((tmp_path / "srv" / "prompts.jsonl").read_text().splitlines()) == 7
    )
    rep = json.loads((tmp_path / "srv" / "prompts_report.json").read_text())
    assert rep["regeneration"]["answers"] == 13 and rep["counts"]["regenerated"] == 7
    p = _run01(_setup(tmp_path, tiny_llama_dir, "plain"), 2, "--no-regenerate")
    assert (
        p.stdout.count("prompts: ") == 1
        and len((tmp_path / "plain" / "prompts.jsonl").read_text().splitlines()) == 7
    )


RANK1_ARGS = (
    Path(__file__).resolve().parents[1] / "_rank1_args.py"
)  # extra arguments on rank 1 alone


@pytest.mark.slow
def test_ranks_that_read_other_settings_stop_at_once_in_one_line(tmp_path, tiny_llama_dir):
    """Every rank reads the config and the source files itself; on a node with another copy, rank 1 read other ones
    (here through extra ``--set`` arguments for rank 1 alone). With prompts.jsonl up to date for rank 0's settings,
    rank 0 returned and rank 1 waited for it in the process group's set-up (3 hours; deaf to SIGTERM); with other
    source content, every answer was regenerated before the merge refused rank 1's log. The ranks now compare their
    settings first: one line naming rank 1 and the differing keys, every rank exits 2, prompts.jsonl unchanged."""
    cfg = _setup(tmp_path, tiny_llama_dir, "one")
    _run01(cfg, 1)
    before = (tmp_path / "one" / "prompts.jsonl").read_bytes()
    other = tmp_path / "other.jsonl"
    other.write_text(
        (tmp_path / "convs.jsonl").read_text().replace("how many legs", "how many arms")
    )
    wrap = RANK1_ARGS
    for extra, keys in (
        ("--set prompts.max_new_tokens=5", "max_new_tokens"),
        (f"--set prompts.source={other}", "sha256, source"),
    ):
        env = child_env(ROOT, RANK1_EXTRA=extra)
        p = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc_per_node",
                "2",
                str(wrap),
                str(ROOT / "01_prepare_prompts.py"),
                "--config",
                str(cfg),
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
        )
        errors = [ln for ln in (p.stdout + p.stderr).splitlines() if ln.startswith("error: ")]
        assert p.returncode != 0 and "exitcode  : 2" in p.stderr, p.stderr[-3000:]
        assert errors == [
            f"error: {tmp_path / 'one' / 'prompts.jsonl'}: torchrun rank 1 read other 01 settings or "
            f"prompts.source files than rank 0 (differing: {keys}); every rank must read the same config "
            f"and source files (a node with another copy of them?)"
        ], p.stderr[-3000:]
        assert (tmp_path / "one" / "prompts.jsonl").read_bytes() == before and all_logs(
            tmp_path / "one"
        ) == []


@pytest.mark.slow
def test_each_replica_names_its_rank_in_its_bar_and_lines(tmp_path, tiny_llama_dir):
    """``torchrun --nproc_per_node 2 01`` showed two `regenerate` bars and two `regeneration prompts: ...` lines (and
    two `prompts.regen_compile: ...` lines) with other figures and no rank: one line said twice, it seemed. Each now
    names its replica (`rank r/2`), as 02's `capture rank r/2` bars do; one process is unchanged."""
    cfg = _setup(tmp_path, tiny_llama_dir, "two")
    out = _run01(cfg, 2).stderr.replace("\r", "\n").splitlines()
    for r in (0, 1):
        assert any(ln.startswith(f"regenerate rank {r}/2: ") for ln in out), out[-20:]
        assert (
            len(
                [
                    ln
                    for ln in out
                    if f"INFO eagle3.regen.regenerate: rank {r}/2: regeneration prompts: " in ln
                ]
            )
            == 1
        )
        assert (
            len(
                [
                    ln
                    for ln in out
                    if f"INFO eagle3.regen.slots: rank {r}/2: prompts.regen_compile: " in ln
                ]
            )
            == 1
        )
    assert not [ln for ln in out if "INFO eagle3.regen.regenerate: regeneration prompts: " in ln]
    one = _setup(tmp_path, tiny_llama_dir, "one")
    out1 = _run01(one, 1).stderr.replace("\r", "\n").splitlines()
    assert any(ln.startswith("regenerate: ") for ln in out1) and not any(
        " rank " in ln for ln in out1 if "regenerat" in ln
    )
