"""Every CLI input path follows the error contract (issue 11 item 7): bad flags, bad ``--set``
overrides and bad config files end in ONE line ``error: <names the flag / override / file>: ...``
on stderr and exit status 2, never a traceback.

Each case runs in-process through ``eagle3.cli.run_main(main, argv)`` (fast: no interpreter start);
one subprocess per script checks the real entry point with the issue's own input (a Jinja template
as a ``--set`` value).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3.cli import run_main

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = [
    "01_prepare_prompts.py",
    "02_extract_hidden.py",
    "03_prepare_data.py",
    "04_train.py",
    "05_benchmark.py",
    "bench/extract_throughput.py",
    "bench/offline_bench_speed.py",
]
BASE = "run_name: r\nverifier:\n  path: {root}/no-verifier\nprompts:\n  source: {root}/no-prompts.jsonl\n"


def _load_main(script: str):
    spec = importlib.util.spec_from_file_location("cli_" + Path(script).stem, ROOT / script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main


def _fill(text: str, files: dict) -> str:
    """Replace ``{name}`` placeholders (not str.format: the cases contain Jinja braces)."""
    for k, v in files.items():
        text = text.replace("{" + k + "}", str(v))
    return text


@pytest.fixture
def files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # any default outputs/ would land here (and must not appear)
    good = tmp_path / "run.yaml"
    good.write_text(BASE.format(root=tmp_path))
    as_list = tmp_path / "list.yaml"
    as_list.write_text("- run_name: r\n- verifier: x\n")
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"run_name: \xff\xfe\n")
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "bad-turns.jsonl").write_text(
        '{"messages": [{"role": "user", "content": "hi"}]}\n'
        '{"messages": [{"role": "user", "content": ""}, {"role": "assistant", "content": "x"}]}\n'
        '{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": ""}]}\n'
    )
    return {
        "good": str(good),
        "list": str(as_list),
        "binary": str(binary),
        "dir": str(tmp_path),
        "missing": str(tmp_path / "missing.yaml"),
        "root": tmp_path,
    }


# (argv after the script, text that must start the message after "error: ") -- valid for every script;
# {good} etc. are filled from the ``files`` fixture
COMMON = [
    (
        ["--config", "{good}", "--set", "verifier.chat_template={{ x }}"],
        "--set verifier.chat_template={{ x }}: value is not valid YAML",
    ),
    (
        ["--config", "{good}", "--set", "verifier.chat_template={% if x %}a{% endif %}"],
        "--set verifier.chat_template={% if x %}a{% endif %}: value is not valid YAML",
    ),
    (
        ["--config", "{good}", "--set", "verifier.chat_template={ x }"],
        "--set verifier.chat_template={ x }: field 'verifier.chat_template': Input should be a valid string",
    ),
    (["--config", "{good}", "--set", "train.lr"], "--set train.lr: expected section.key=value"),
    (["--config", "{good}", "--set", "=3"], "--set =3: empty key name"),
    (
        ["--config", "{good}", "--set", "nosuch.key=1"],
        "--set nosuch.key=1: unknown config key 'nosuch'",
    ),
    (
        ["--config", "{good}", "--set", "train.learning_rate=1"],
        "--set train.learning_rate=1: unknown config key 'train.learning_rate'",
    ),
    (["--config", "{good}", "--set", "train.lr=fast"], "--set train.lr=fast: field 'train.lr'"),
    (
        ["--config", "{good}", "--set", "train.batch_size=[1, 2]"],
        "--set train.batch_size=[1, 2]: field 'train.batch_size'",
    ),
    (
        ["--config", "{good}", "--set", "run_name.x=1"],
        "--set run_name.x=1: 'run_name' is a value, not a section",
    ),
    (["--config", "{good}", "--set", "verifier=null"], "--set verifier=null: field 'verifier'"),
    (["--config", "{missing}"], "{missing}: config file not found"),
    (["--config", "{dir}"], "{dir}: config file not found (it is a directory)"),
    (["--config", "{list}"], "{list}: the config must be a YAML mapping"),
    (
        ["--config", "{binary}"],
        "{binary}:1: not UTF-8 text: byte 0xff at column 11 (byte 10 of the file)",
    ),
    ([], "the following arguments are required: --config"),
    (["--config", "{good}", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
]

# flags of one script (and the paths they name that do not exist)
PER_SCRIPT = {
    "01_prepare_prompts.py": [
        (["--limit", "0"], "argument --limit: must be >= 1, got 0"),
        (["--limit", "ten"], "argument --limit: expected an integer >= 1, got 'ten'"),
        (["--format", "csv"], "argument --format: invalid choice: 'csv'"),
        (["--source", "{root}/nope.jsonl"], "{root}/nope.jsonl: prompts file not found"),
        ([], "{root}/no-prompts.jsonl: prompts file not found"),
        (
            ["--source", "{root}/empty.jsonl"],
            "prompts.source: no usable conversation in '{root}/empty.jsonl': no records",
        ),
        (
            ["--source", "{root}/bad-turns.jsonl"],
            "prompts.source: no usable conversation in '{root}/bad-turns.jsonl': "
            "read 3 records, skipped 3 (empty content: 2, no assistant: 1); "
            "prompt-only sources need prompts.regenerate: true",
        ),
        (
            ["--set", "prompts.server.urls=[node1:30000]"],
            "--set prompts.server.urls=[node1:30000]: field 'prompts.server.urls[0]'",
        ),
    ],
    "02_extract_hidden.py": [
        (["--limit", "-3"], "argument --limit: must be >= 1, got -3"),
        (["--backend", "vllm"], "argument --backend: invalid choice: 'vllm'"),
        (
            ["--server", "localhost:30000"],
            "argument --server: expected http://host:port, got 'localhost:30000'",
        ),
        (
            ["--set", "extract.sglang_url=127.0.0.1"],
            "--set extract.sglang_url=127.0.0.1: field 'extract.sglang_url'",
        ),
        (
            ["--set", "output_root={good}/under-a-file"],
            "output_root: cannot create the output folder "
            "{good}/under-a-file/shards: {good} is a file, not a folder",
        ),
        ([], "outputs/r/prompts.jsonl: prompts file not found"),
    ],
    "03_prepare_data.py": [
        (
            [],
            "outputs/r/shards/data_config.json: file not found (02_extract_hidden.py writes it: run that stage first; "
            "relative paths are read from the current folder, ",
        ),
        (["--set", "extract.output_dir={root}/nope"], "{root}/nope"),
    ],
    "04_train.py": [
        (["--max-steps", "0"], "argument --max-steps: must be >= 1, got 0"),
        (["--engine", "trt"], "argument --engine: invalid choice: 'trt'"),
        (
            [],
            "outputs/r/shards/data_config.json: file not found (02_extract_hidden.py writes it: run that stage first; "
            "relative paths are read from the current folder, ",
        ),
        (["--export-only"], "outputs/r/train"),
    ],
    "05_benchmark.py": [
        (["--steps", "0"], "argument --steps: must be >= 1, got 0"),
        (["--num-prompts", "x"], "argument --num-prompts: expected an integer >= 1, got 'x'"),
        # a flag of the other mode: was ignored without a word
        (
            ["--server", "http://h:1", "--batch-size", "4", "--serve-aux-layers", "1", "2", "3"],
            "--batch-size, --serve-aux-layers: not used in server mode (--server or benchmark.server_urls)",
        ),
        (
            ["--set", "benchmark.server_urls=[http://h:1]", "--steps", "2"],
            "--steps: not used in server mode",
        ),
        (
            ["--concurrency", "4"],
            "--concurrency: not used in the offline benchmark (server mode needs --server or "
            "benchmark.server_urls)",
        ),
        (["--timeout", "-1"], "argument --timeout: must be a finite number > 0, got -1"),
        (["--concurrency", "0"], "argument --concurrency: must be >= 1, got 0"),
        (
            ["--serve-aux-layers", "1", "2", "x"],
            "argument --serve-aux-layers: invalid int value: 'x'",
        ),
        (["--tie-tolerance", "-0.5"], "argument --tie-tolerance: must be >= 0, got -0.5"),
        (["--server", "notaurl"], "argument --server: expected http://host:port, got 'notaurl'"),
        (["--server", "http://h:port"], "argument --server: not a valid URL"),
        (
            ["--set", "benchmark.server_urls=[ftp://x]"],
            "--set benchmark.server_urls=[ftp://x]: field 'benchmark.server_urls[0]': expected http://host:port",
        ),
        (["--drafter", "{root}/no-drafter"], "--drafter: folder '{root}/no-drafter' not found"),
        (
            [],
            "the exported drafter 'outputs/r/drafter-sglang' (the config's export dir) not found: run 04_train.py first or pass --drafter",
        ),
    ],
    "bench/offline_bench_speed.py": [
        (["--num-prompts", "0"], "--batch-sizes, --num-prompts"),
        (["--batch-sizes", "8", "x"], "argument --batch-sizes: invalid int value: 'x'"),
        (
            ["--headline-batch-size", "0"],
            "--headline-batch-size must be >= 1",
        ),  # was taken as unset
        (
            ["--json", "{root}"],
            "--json {root}: is a folder; give a file path",
        ),  # was found after the measuring
    ],
    "bench/extract_throughput.py": [
        (["--batch", "0"], "argument --batch: must be >= 1, got 0"),
        ([], "verifier.path: folder '{root}/no-verifier' not found"),
        (["--set", "verifier.device=gpu7"], "verifier.path: folder '{root}/no-verifier' not found"),
    ],
}

CASES = [(s, argv, want) for s in SCRIPTS for argv, want in COMMON] + [
    (s, ["--config", "{good}", *argv], want)
    for s, cases in PER_SCRIPT.items()
    for argv, want in cases
]


@pytest.mark.parametrize(
    "script, argv, want", CASES, ids=[f"{Path(s).stem}:{' '.join(a)[:50]}" for s, a, _ in CASES]
)
def test_bad_input_is_one_error_line_and_exit_2(files, capsys, script, argv, want):
    main = _load_main(script)
    argv = [_fill(a, files) for a in argv]
    want = _fill(want, files)
    with pytest.raises(SystemExit) as e:
        run_main(main, argv)
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert e.value.code == 2, err
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"error: {want}"), lines[0]
    left = sorted(str(p.relative_to(files["root"])) for p in (files["root"] / "outputs").rglob("*"))
    assert not left, (
        f"a refused run left {left} behind"
    )  # nothing half-written (04 made an empty train/)


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_entry_point_jinja_override_exits_2(tmp_path, script):
    """The issue's input through the real entry point: no traceback, exit 2, one ``error:`` line."""
    cfg = tmp_path / "run.yaml"
    cfg.write_text(BASE.format(root=tmp_path))
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / script),
            "--config",
            str(cfg),
            "--set",
            "verifier.chat_template={% for m in messages %}{{ m.content }}{% endfor %}",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [
        "error: --set verifier.chat_template={% for m in messages %}{{ m.content }}{% endfor %}: value is not "
        "valid YAML (found character '%' that cannot start any token); to pass it as a string, quote it: "
        "--set \"verifier.chat_template='...'\""
    ]


def test_a_relative_path_not_found_names_the_current_folder(tmp_path, monkeypatch):
    """A config with a relative output_root run from another folder than the earlier stages: 03 said `out/shards/
    data_config.json: file not found (02_extract_hidden.py writes it: run that stage first)` of a stage that had run
    (trial 2026-12-05g). A relative path not found now names the folder it was read from; an absolute one is as
    before."""
    from eagle3.config import load_config
    from eagle3.errors import UserError
    from eagle3.io import file_not_found
    from eagle3.stages.benchmark import resolve_drafter_dir

    monkeypatch.chdir(tmp_path)
    assert str(file_not_found("out/shards/data_config.json")) == (
        "out/shards/data_config.json: file not found (02_extract_hidden.py writes it: run that stage first; relative "
        f"paths are read from the current folder, {tmp_path})"
    )
    assert str(file_not_found("notes.txt")) == (
        f"notes.txt: file not found (relative paths are read from the current folder, {tmp_path})"
    )
    assert str(file_not_found("/x/other.json")) == "/x/other.json: file not found"
    (tmp_path / "run.yaml").write_text(
        "run_name: r\noutput_root: out\nverifier: {path: v}\nprompts: {source: s}\n"
    )
    cfg = load_config(tmp_path / "run.yaml")
    with pytest.raises(UserError) as e:
        resolve_drafter_dir(cfg, None)
    assert str(e.value) == (
        "the exported drafter 'out/drafter-sglang' (the config's export dir) not found: run "
        f"04_train.py first or pass --drafter (relative paths are read from the current folder, "
        f"{tmp_path})"
    )
    with pytest.raises(UserError) as e:
        resolve_drafter_dir(cfg, "out/x")
    assert str(e.value) == (
        "--drafter: folder 'out/x' not found (export a trained drafter first; relative paths are "
        f"read from the current folder, {tmp_path})"
    )


def test_written_by_names_the_files_as_the_stages_define_them():
    """The "run that stage first" table uses the stages' own file names, and a missing one says which stage."""
    from eagle3.data.outputs import SPLIT
    from eagle3.data.vocab import TOKEN_FREQ, VOCAB_MAP
    from eagle3.io import read_json
    from eagle3.io.read import WRITTEN_BY, file_not_found, safe_torch_load
    from eagle3.shards.format import DATA_CONFIG
    from eagle3.shards.manifest import MANIFEST
    from eagle3.verifier.head import FILENAME

    assert WRITTEN_BY == {
        "prompts.jsonl": "01_prepare_prompts.py",
        DATA_CONFIG: "02_extract_hidden.py",
        MANIFEST: "02_extract_hidden.py",
        VOCAB_MAP: "03_prepare_data.py",
        TOKEN_FREQ: "03_prepare_data.py",
        SPLIT: "03_prepare_data.py",
        FILENAME: "04_train.py",
    }
    assert str(file_not_found("/x/other.json")) == "/x/other.json: file not found"
    with pytest.raises(
        Exception, match=r"^/nope/data/vocab_map.pt: file not found \(03_prepare_data.py writes it"
    ):
        safe_torch_load("/nope/data/vocab_map.pt")
    with pytest.raises(
        Exception, match=r"^/nope/data/split.json: file not found \(03_prepare_data.py writes it"
    ):
        read_json("/nope/data/split.json")


@pytest.mark.parametrize(
    "script, argv, want",
    [
        (
            "03_prepare_data.py",
            [],
            "03_prepare_data.py runs in one process (it writes one vocab map, split and validation "
            "record for every rank of 04); run it without torchrun (WORLD_SIZE=2)",
        ),
        (
            "05_benchmark.py",
            [],
            "05_benchmark.py runs in one process (copies would decode side by side, each measuring the "
            "others' load as its tokens/s, and write the same report); run it without torchrun "
            "(WORLD_SIZE=2)",
        ),
        (
            "04_train.py",
            ["--export-only"],
            "04_train.py --export-only runs in one process (it writes one export folder; "
            "every rank would write it); run it without torchrun (WORLD_SIZE=2)",
        ),
        (
            "01_prepare_prompts.py",
            ["--self-instruct", "3", "--out", "{root}/si.jsonl"],
            "--self-instruct runs in one process (it takes seconds to minutes on one GPU); run it without torchrun "
            "(WORLD_SIZE=2)",
        ),
    ],
)
def test_one_process_stages_refuse_torchrun_in_one_line(
    files, capsys, monkeypatch, script, argv, want
):
    """`torchrun --nproc_per_node 2 05_benchmark.py` ran the whole benchmark on every rank (two reports, each rank's
    tokens/s measured beside the other's decoding), and 03 and `04 --export-only` wrote the same files from every
    rank (fresh-user trial 2026-12-05f); like `01 --self-instruct`, they now stop at once with one line."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as e:
        run_main(_load_main(script), ["--config", files["good"], *[_fill(a, files) for a in argv]])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.strip().splitlines() == [f"error: {want}"], err
    assert not (files["root"] / "outputs").exists()


@pytest.mark.parametrize(
    "script, says",
    [
        (
            "04_train.py",
            "--export-only no training: export the trained weights (the newest checkpoint's; with "
            "train.select_best: sim_accept the best validation's, best_drafter.pt)",
        ),
        (
            "05_benchmark.py",
            "--drafter DRAFTER exported drafter folder (default: export.output_dir, else "
            "{output_root}/drafter-{export.engine})",
        ),
        (
            "03_prepare_data.py",
            "--no-plot skip coverage.png (an earlier run's is removed: it would show another draft "
            "vocab)",
        ),
    ],
)
def test_help_of_03_04_05_says_what_the_flag_does(script, says, capsys):
    """`04 --help` said --export-only exports "the newest checkpoint", but under train.select_best: sim_accept it
    exports best_drafter.pt's weights; `05 --help` named the default drafter folder `cfg.export_dir`, a name found in
    no config (trial 2026-12-05g)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(script[:-3].replace("_", ""), ROOT / script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    with pytest.raises(SystemExit) as e:
        mod.main(["--help"])
    assert e.value.code == 0
    assert says in " ".join(capsys.readouterr().out.split())


def test_a_ctrl_c_inside_the_torch_import_ends_with_the_interrupted_line(tmp_path):
    """A Ctrl-C that lands inside `import torch` (a stage's first seconds; `timeout -s INT 10 03_prepare_data.py`
    under load) left torch's logging unset, so its atexit hook logged `INFO torch._subclasses.fake_tensor: FakeTensor
    cache stats:` and two more lines AFTER `interrupted by SIGINT` (fresh-user trial 2026-12-05h). The hook is
    reproduced here by a logger of torch's name that nothing has configured."""
    code = (
        "import atexit, logging\n"
        "from eagle3.cli import run_main\n"
        "def main(argv):\n"
        "    atexit.register(lambda: logging.getLogger('torch._subclasses.fake_tensor').info('FakeTensor cache "
        "stats:'))\n"
        "    raise KeyboardInterrupt\n"
        "run_main(main)\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 130 and p.stderr.strip().splitlines() == ["interrupted by SIGINT"], (
        p.stderr
    )
