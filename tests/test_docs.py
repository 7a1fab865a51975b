"""The user docs (README.md, DESIGN.md, docs/*.md, patches/README.md, bench/README.md) and the YAML comments in
configs/ against the code, so that a renamed key, flag, module or results file fails here instead of costing a user a day:

- every ``section.key`` they name is a field of ``eagle3.config.RunConfig`` (or a module attribute written
  ``stage_module.name``, or a file name);
- DESIGN.md's module map lists exactly the modules under ``eagle3/``;
- every repository path they cite (``eagle3/``, ``tests/``, ``scripts/``, ``patches/``, ``configs/``, ``docs/``,
  ``bench/results/``, ``bench/plans/``, ``bench/*.py``; ``{a,b}`` expanded, ``*`` globbed) exists;
- every flag they give a script (in a code span or block, after the script's name) is in that script's
  ``--help``, every script they run that way has a working ``--help``, and every other ``--flag`` they name is one
  of the project's scripts' or a known external tool's (SGLang, vLLM, pip, torchrun).
"""

from __future__ import annotations

import functools
import glob
import re
import subprocess
import sys
import typing
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from pydantic import BaseModel

from eagle3.config import RunConfig

ROOT = Path(__file__).resolve().parents[1]
DOCS = [
    "README.md",
    "DESIGN.md",
    *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md")),
    "patches/README.md",
    "bench/README.md",
]
CONFIGS = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "configs").glob("*.yaml"))
SECTIONS = ("verifier", "prompts", "extract", "data", "drafter", "train", "export", "benchmark")
FILE_EXTS = {
    "py",
    "json",
    "jsonl",
    "md",
    "pt",
    "png",
    "gz",
    "lock",
    "yaml",
    "sh",
    "env",
    "safetensors",
    "txt",
}
#: flags of tools outside this repository that the docs quote (SGLang, vLLM, pip, torchrun)
EXTERNAL_FLAGS = {
    "--model-path",
    "--tp-size",
    "--trust-remote-code",
    "--host",
    "--port",
    "--speculative-algorithm",
    "--speculative-draft-model-path",
    "--speculative-num-steps",
    "--speculative-eagle-topk",
    "--speculative-num-draft-tokens",
    "--speculative-config",
    "--model",
    "--tensor-parallel-size",
    "--served-model-name",
    "--chunked-prefill-size",
    "--disable-radix-cache",
    "--disable-overlap-schedule",
    "--enable-dp-attention",
    "--enable-two-batch-overlap",
    "--enable-return-aux-hidden-states",
    "--return-aux-hidden-state-layer-ids",
    "--return-hidden-states-mode",
    "--max-prefill-tokens",
    "--pp-size",
    "--dtype",
    "--no-deps",
    "--nproc_per_node",
    "--flag",
}
#: the SGLang capture launcher's own flags (it has no argparse --help: the rest of its command line goes to SGLang)
LAUNCHER = "patches/sglang_capture_launcher.py"
LAUNCHER_FLAGS = {"--capture-dir", "--max-length"}


def doc_lines(files):
    for fn in files:
        for i, line in enumerate((ROOT / fn).read_text().splitlines(), 1):
            yield fn, i, line


def _submodel(model: type[BaseModel], name: str):
    """``(sub-model or None, found)`` of field ``name`` of ``model``."""
    field = model.model_fields.get(name)
    if field is None:
        return None, False

    def find(a):
        if isinstance(a, type) and issubclass(a, BaseModel):
            return a
        for x in typing.get_args(a):
            if (r := find(x)) is not None:
                return r
        return None

    return find(field.annotation), True


def config_key_exists(dotted: str) -> bool:
    model: type[BaseModel] | None = RunConfig
    for part in dotted.split("."):
        if model is None:
            return False
        model, found = _submodel(model, part)
        if not found:
            return False
    return True


def module_attr_exists(dotted: str) -> bool:
    """``loop.capture_and_write`` / ``data.dataset.collate``: a function, class or name of an eagle3 module."""
    parts = dotted.split(".")
    for k in range(len(parts) - 1, 0, -1):
        mods = glob.glob(
            str(ROOT / "eagle3" / "**" / ("/".join(parts[:k]) + ".py")), recursive=True
        )
        for m in mods:
            name = parts[k]
            if re.search(
                rf"^\s*(?:def|class)\s+{re.escape(name)}\b|^{re.escape(name)}\s*[:=]",
                Path(m).read_text(),
                re.M,
            ):
                return True
    return False


KEY_RE = re.compile(
    r"(?<![\w./-])(" + "|".join(SECTIONS) + r")\.([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)(?![\w-])"
)


#: a quoted example of the unknown-key error (``unknown config key 'train.lrr'``): the key in it is wrong on purpose
UNKNOWN_KEY_QUOTE_RE = re.compile(r"unknown config key '([^']*)'")


def named_keys():
    for fn, i, line in doc_lines(DOCS + CONFIGS):
        if fn.endswith(".yaml"):
            if "#" not in line:
                continue
            line = line[line.index("#") :]  # the comment only
        line = UNKNOWN_KEY_QUOTE_RE.sub(
            "unknown config key ''", line
        )  # checked by the test below instead
        for m in KEY_RE.finditer(line):
            yield fn, i, f"{m.group(1)}.{m.group(2)}"


def unknown_key_quotes():
    """``(file, line, key)`` of every quoted unknown-key error example in the docs."""
    for fn, i, line in doc_lines(DOCS):
        for m in UNKNOWN_KEY_QUOTE_RE.finditer(line):
            yield fn, i, m.group(1)


def test_keys_quoted_as_unknown_are_unknown():
    """The README's error examples quote keys that must stay wrong (fresh-user trial 2026-12-05g: README.md's
    ``unknown config key 'train.draft_vocab_size'`` example failed the key check above, so ``bash scripts/test.sh``
    failed on a fresh clone)."""
    quoted = list(unknown_key_quotes())
    assert ("train.lrr", "train.draft_vocab_size") == tuple(
        k for fn, _, k in quoted if fn == "README.md"
    )[:2]
    assert not [f"{fn}:{i}: {k}" for fn, i, k in quoted if config_key_exists(k)]


def test_every_config_key_the_docs_name_exists():
    found, bad = 0, []
    for fn, i, key in named_keys():
        last = key.rsplit(".", 1)[-1]
        if last in FILE_EXTS:
            continue
        found += 1
        if not config_key_exists(key) and not module_attr_exists(key):
            bad.append(f"{fn}:{i}: {key}")
    assert found > 300, found  # the docs name hundreds: a regex that finds none must not pass
    assert not bad, (
        "keys named in the docs that eagle3/settings/ (RunConfig) does not have:\n" + "\n".join(bad)
    )


def test_key_check_catches_a_wrong_key():
    assert config_key_exists("prompts.self_instruct.batch_size") and config_key_exists(
        "train.select_chain"
    )
    assert not config_key_exists("prompts.self_instruct.batch") and not config_key_exists(
        "train.select_best_chain"
    )
    assert module_attr_exists("loop.capture_and_write") and not module_attr_exists(
        "loop.capture_and_writ"
    )


def design_module_map() -> set[str]:
    text = (ROOT / "DESIGN.md").read_text()
    block = text.split("## Module map", 1)[1].split("```", 2)[1]
    listed, pkg = set(), None
    for line in block.splitlines()[1:]:
        m = re.match(r"^( *)(\S+)", line)
        if not m:
            continue
        indent, name = len(m.group(1)), m.group(2)
        if indent == 2:
            pkg = name[:-1] if name.endswith("/") else None
            if pkg is None:
                listed.add(f"eagle3/{name}")
        elif indent == 4 and pkg:
            listed.add(f"eagle3/{pkg}/{name}")
    return listed


def test_design_module_map_lists_every_module():
    listed = design_module_map()
    actual = {
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / "eagle3").rglob("*.py")
        if p.name != "__init__.py"
    }
    assert len(listed) > 50
    assert not actual - listed, (
        f"modules missing from DESIGN.md's module map: {sorted(actual - listed)}"
    )
    assert not listed - actual, (
        f"DESIGN.md's module map lists modules that do not exist: {sorted(listed - actual)}"
    )


def expand_braces(s: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", s)
    if not m:
        return [s]
    return [
        x
        for alt in m.group(1).split(",")
        for x in expand_braces(s[: m.start()] + alt + s[m.end() :])
    ]


PATH_RE = re.compile(
    r"(?<![\w/.-])((?:eagle3|tests|bench|scripts|patches|configs|docs)/[\w.*{},/-]*[\w*}/])"
)


def cited_paths():
    for fn, i, line in doc_lines(DOCS + CONFIGS):
        for m in PATH_RE.finditer(line):
            p = m.group(1)
            if p.startswith("bench/") and not re.match(
                r"bench/(results|plans)/|bench/[\w.-]+\.(py|sh)$", p
            ):
                continue  # bench/bench.json etc.: stage 05's output folder, not the repository's bench/
            for q in expand_braces(p):
                yield fn, i, q.rstrip("/")


def test_every_cited_repository_path_exists():
    paths = list(cited_paths())
    assert sum(q.startswith("bench/results/") for _, _, q in paths) > 50
    bad = [f"{fn}:{i}: {q}" for fn, i, q in paths if not glob.glob(str(ROOT / q))]
    assert not bad, "paths cited in the docs that do not exist:\n" + "\n".join(bad)


@functools.lru_cache(maxsize=None)
def help_flags(script: str) -> frozenset[str]:
    r = subprocess.run(
        [sys.executable, str(ROOT / script), "--help"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert r.returncode == 0, f"{script} --help: exit {r.returncode}\n{r.stderr[-2000:]}"
    return frozenset(re.findall(r"(?<![\w-])(--[a-z][a-z0-9_-]*)", r.stdout))


SCRIPT_RE = re.compile(r"^((?:bench/|scripts/)?[\w]+\.py)$")


def command_units():
    """Code spans (also those broken over two lines) and code-block lines of the docs (README, DESIGN, docs/ with the
    measurement log docs/results.md, patches/README.md) and the YAML comments, each with the line it starts on."""
    for fn in DOCS + CONFIGS:
        lines = (ROOT / fn).read_text().splitlines()
        if fn.endswith(".yaml"):
            yield from ((fn, i, line) for i, line in enumerate(lines, 1))
            continue
        in_block, prose = False, []
        for i, line in enumerate(lines, 1):
            if line.strip().startswith("```"):
                in_block = not in_block
            elif in_block:
                yield fn, i, line
            else:
                prose.append((i, line))
        text = "\n".join(line for _, line in prose)
        starts = [0]
        for _, line in prose:
            starts.append(starts[-1] + len(line) + 1)
        for m in re.finditer(r"`([^`]+)`", text):
            k = next(j for j in range(len(prose)) if starts[j + 1] > m.start())
            yield fn, prose[k][0], m.group(1)


def script_flag_uses():
    """``(file, line, script, flag)`` for each flag written after a repository script's name."""
    for fn, i, unit in command_units():
        script, prev = None, ""
        for tok in unit.split():
            tok, prev_tok = tok.strip("()[],;"), prev
            prev = tok
            if SCRIPT_RE.match(tok):
                # a bench script may be named without its folder (`offline_bench_speed.py --pick`); a bare name that
                # is no script (DESIGN's module map: `config.py  ... --set`) is a command only after `python`
                found = [s for s in (tok, f"bench/{tok}") if (ROOT / s).is_file()]
                if found:
                    script = found[0]
                elif prev_tok == "python" or re.match(r"(bench|scripts)/|\d\d_", tok):
                    script = f"{tok} (no such script)"
                else:
                    script = None
                continue
            m = re.match(r"--[a-z][a-z0-9_-]*", tok)
            if m and script:
                yield fn, i, script, m.group(0)


@pytest.mark.slow  # ~25 s on the 2-core machine: a --help of each of ~15 scripts
def test_every_flag_given_to_a_script_is_in_its_help():
    uses = list(script_flag_uses())
    scripts = {s for _, _, s, _ in uses}
    assert {
        "01_prepare_prompts.py",
        "02_extract_hidden.py",
        "04_train.py",
        "05_benchmark.py",
    } <= scripts
    missing = sorted({f"{fn}:{i}: {s}" for fn, i, s, _ in uses if s.endswith("(no such script)")})
    assert not missing, (
        "commands in the docs that run a script this repository does not have:\n"
        + "\n".join(missing)
    )
    with ThreadPoolExecutor(2) as ex:  # each --help is a Python start-up + imports: two at a time
        list(ex.map(help_flags, sorted(scripts)))
    bad = [f"{fn}:{i}: {s} {f}" for fn, i, s, f in uses if f not in help_flags(s)]
    assert not bad, "flags the docs give a script that its --help does not list:\n" + "\n".join(bad)


@pytest.mark.slow  # the same --help runs when it runs alone
def test_every_other_flag_the_docs_name_exists_somewhere():
    scripts = [
        "01_prepare_prompts.py",
        "02_extract_hidden.py",
        "03_prepare_data.py",
        "04_train.py",
        "05_benchmark.py",
        "convert_shards.py",
    ]
    scripts += sorted(
        {s for _, _, s, _ in script_flag_uses() if not s.endswith("(no such script)")}
    )
    launcher = (ROOT / LAUNCHER).read_text()
    assert all(f'"{f}"' in launcher for f in LAUNCHER_FLAGS), (
        "a launcher flag is gone: update LAUNCHER_FLAGS and the docs"
    )
    known = set().union(*(help_flags(s) for s in scripts)) | EXTERNAL_FLAGS | LAUNCHER_FLAGS
    bad = []
    for fn, i, line in doc_lines(
        ["README.md", "DESIGN.md", "docs/sglang.md", "docs/stages.md", "patches/README.md"]
        + CONFIGS
    ):
        for f in re.findall(r"(?<![\w-])(--[a-z][a-z0-9_-]*)", line):
            if f not in known and not (f.endswith("-") and any(k.startswith(f) for k in known)):
                bad.append(f"{fn}:{i}: {f}")
    assert not bad, (
        "flags named in the docs that no script of this repository (nor a known tool) has:\n"
        + "\n".join(bad)
    )


@pytest.mark.parametrize(
    "script", ["01_prepare_prompts.py", "03_prepare_data.py", "04_train.py", "05_benchmark.py"]
)
def test_help_flags_reads_real_flags(script):
    flags = help_flags(script)
    assert "--config" in flags and "--set" in flags and "--no-such-flag" not in flags


DEFAULT_RE = re.compile(
    r"`((?:"
    + "|".join(SECTIONS)
    + r")\.[a-z_.]+)(?::\s*([^`]+))?`\s?[(,]\s*default(:?)\s*(`[^`]+`|[^,;)]+)?"
)


def documented_defaults():
    """``(file, line, key, stated default)`` for ``key` (default X`, ``key`, default X`` and ``key: X`, default``."""
    for fn, i, line in doc_lines([d for d in DOCS if d != "docs/results.md"] + CONFIGS):
        for m in DEFAULT_RE.finditer(line):
            key, inline, colon, value = m.groups()
            if inline and (colon or not value):
                yield (
                    fn,
                    i,
                    key,
                    inline.strip(),
                )  # `prompts.regen_engine: slots`, default: ... = slots
            elif value and not inline:
                yield fn, i, key, value.strip().strip("`")


def default_of(key: str):
    model, field = RunConfig, None
    for part in key.split("."):
        field = model.model_fields[part]
        model, _ = _submodel(model, part)
    return field.default if field.default_factory is None else field.default_factory()


def literal_options(key: str) -> set:
    model, field = RunConfig, None
    for part in key.split("."):
        field = model.model_fields[part]
        model, _ = _submodel(model, part)

    def walk(a):
        if typing.get_origin(a) is typing.Literal:
            return set(typing.get_args(a))
        return set().union(*(walk(x) for x in typing.get_args(a))) if typing.get_args(a) else set()

    return walk(field.annotation)


def parse_stated(value: str):
    """A literal the docs state (``true``, ``1/32``, ``1 GB``, ``0.05``, ``auto``), or None for a reference to another
    setting or prose (``benchmark.steps``, ``the verifier's``, ``once per epoch``): such defaults are null fields."""
    word = value.split(":")[0].split()[0] if value.split() else value
    if KEY_RE.fullmatch(value) or not re.fullmatch(r"[\w./-]+", word):
        return None
    if m := re.fullmatch(r"(\d+)/(\d+)", word):
        return int(m.group(1)) / int(m.group(2))
    if m := re.fullmatch(r"([\d.]+) GB", value.strip()):
        return float(m.group(1)) * 1e9
    if word in ("true", "false"):
        return word == "true"
    try:
        return (
            float(word)
            if re.fullmatch(r"[\d.e+-]+", word)
            else (word if word.isidentifier() else None)
        )
    except ValueError:
        return None


def default_matches(key: str, value: str) -> bool:
    want, got = parse_stated(value), default_of(key)
    if want is None:
        return (
            got is None
        )  # "default: benchmark.steps" = a null field resolved from another setting
    if isinstance(want, str) and want not in literal_options(key) and not isinstance(got, str):
        return got is None  # prose ("the verifier's", "once per epoch") for a null field
    if isinstance(want, (bool, str)):
        return got == want
    return (
        not isinstance(got, bool)
        and isinstance(got, (int, float))
        and abs(got - want) <= 1e-9 * max(1, abs(want))
    )


def test_every_default_the_docs_state_is_the_config_default():
    stated = list(documented_defaults())
    assert len(stated) >= 10, stated
    bad = [
        f"{fn}:{i}: {key}: the docs say default {value!r}, eagle3/settings/ has {default_of(key)!r}"
        for fn, i, key, value in stated
        if not default_matches(key, value)
    ]
    assert not bad, "\n".join(bad)


def test_default_check_reads_real_values():
    assert (
        parse_stated("1/32") == 1 / 32
        and parse_stated("1 GB") == 1e9
        and parse_stated("true") is True
    )
    assert (
        default_of("prompts.regen_refill_free") == 1 / 32
        and default_of("train.select_chain") is None
    )
    assert literal_options("prompts.regen_engine") == {"slots", "hf_continuous", "static"}
    for key, value in [
        ("train.eval_every", "once per epoch"),
        ("drafter.intermediate_size", "the verifier's"),
        ("train.select_chain", "benchmark.steps"),
        ("prompts.regen_engine", "slots"),
        ("prompts.regen_refill_free", "1/32"),
        ("extract.disk_margin_bytes", "1 GB"),
        ("export.dtype", "auto"),
        ("prompts.regen_prefill_pack", "false until measured"),
    ]:
        assert default_matches(key, value), (key, value)
    for key, value in [
        ("prompts.regen_engine", "static"),
        ("prompts.regen_refill_free", "1/16"),
        ("extract.disk_margin_bytes", "2 GB"),
        ("prompts.regen_prefill_pack", "true"),
        ("export.dtype", "bfloat16"),
        ("extract.batches_in_flight_per_server", "4"),
        ("train.lr", "once per epoch"),
        ("train.select_chain", "3"),
    ]:
        assert not default_matches(key, value), (key, value)


def test_every_committed_config_loads():
    from eagle3.config import load_config

    assert len(CONFIGS) >= 6
    for fn in CONFIGS:
        load_config(ROOT / fn)  # UserError (unknown key, bad value) fails the test


def uncommented_variants(text: str):
    """``(line, yaml)`` per commented-out setting (``  # key: value``, with its commented-out sub-block): the file with
    that setting switched on (an uncommented line of the same key at the same indent is dropped: the alternative)."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"^( *)# ([a-z_]+):(?: |$)", line)
        if not m:
            continue
        indent, key = m.groups()
        block = [i]
        for j in range(i + 1, len(lines)):
            if re.match(rf"^{indent}#   ", lines[j]):
                block.append(j)
            else:
                break
        out = [
            re.sub(rf"^{indent}# ", indent, ln, count=1) if k in block else ln
            for k, ln in enumerate(lines)
            if k in block or not re.match(rf"^{indent}{key}:", ln)
        ]
        yield i + 1, "\n".join(out) + "\n"


def test_commented_out_settings_in_the_configs_are_valid(tmp_path):
    """The examples the YAMLs leave commented out (`# tie_tolerance: 0.25`, `# self_instruct: {num: ...}`) load when
    switched on, so that a user who uncomments one does not meet an unknown key."""
    from eagle3.config import load_config

    n = 0
    for fn in CONFIGS:
        for line, text in uncommented_variants((ROOT / fn).read_text()):
            f = tmp_path / Path(fn).name
            f.write_text(text)
            try:
                load_config(f)
            except Exception as e:  # noqa: BLE001 - the message is the finding
                raise AssertionError(
                    f"{fn}:{line}: the commented-out setting does not load: {e}"
                ) from None
            n += 1
    assert n >= 8


def test_design_orchestration_list_is_the_layout_tests():
    """DESIGN.md names the modules held to "no function over 80 lines"; tests/test_layout.py's ORCHESTRATION is the
    list that is checked."""
    from test_layout import ORCHESTRATION

    m = re.search(
        r"Orchestration modules \(([^)]*?):\s*`ORCHESTRATION`", (ROOT / "DESIGN.md").read_text()
    )
    assert m, "DESIGN.md's orchestration sentence moved: update this test"
    named = {n.strip().strip("`") for n in m.group(1).replace("\n", " ").split(",")}
    checked = {
        Path(p).stem if Path(p).parent.name != "benchmark" else f"benchmark/{Path(p).stem}"
        for p in ORCHESTRATION
    }
    assert named == checked, (
        f"DESIGN.md names {sorted(named - checked)} not checked, misses {sorted(checked - named)}"
    )


def section_names() -> set[str]:
    """Headings of README.md, DESIGN.md and docs/*.md, and the bold names (``- **Exports**:``) of their bullets."""
    names = set()
    for fn in DOCS:
        for line in (ROOT / fn).read_text().splitlines():
            if line.startswith("#"):
                names.add(line.lstrip("#").strip())
            names.update(m.rstrip(".:") for m in re.findall(r"^\s*- \*\*([^*]+)\*\*", line))
    return names


def test_every_quoted_section_exists():
    """``docs/results.md "Lease 2026-12-04e"``, ``DESIGN.md "Online training: the Kimi arithmetic"``, Conventions,
    "Exports": a quoted capitalised name in the docs or YAML comments is a heading (or bold bullet) that exists."""
    names = section_names()
    quoted = [
        (fn, i, m)
        for fn, i, line in doc_lines([d for d in DOCS if d != "docs/results.md"] + CONFIGS)
        for m in re.findall(r'"([A-Z][^"]{3,80})"', line)
    ]
    assert len(quoted) >= 30
    bad = [f"{fn}:{i}: {q!r}" for fn, i, q in quoted if not any(q in n for n in names)]
    assert not bad, "quoted section names that no heading has:\n" + "\n".join(bad)


def test_every_script_the_docs_name_has_a_working_help():
    """Each stage script, convert_shards.py and each bench/ or scripts/ Python script README.md, DESIGN.md or
    docs/sglang.md names answers ``--help`` (exit 0, a usage line and its --config or other flags)."""
    text = "\n".join(
        (ROOT / f).read_text()
        for f in ("README.md", "DESIGN.md", "docs/sglang.md", "docs/stages.md")
    )
    named = sorted(
        set(
            re.findall(
                r"(?<![\w/])((?:bench|scripts)/\w+\.py|0[1-5]_\w+\.py|convert_shards\.py)", text
            )
        )
    )
    assert len(named) >= 10, named
    missing = [s for s in named if not (ROOT / s).is_file()]
    assert not missing, f"scripts the docs name that do not exist: {missing}"
    for s in named:
        assert help_flags(s), f"{s} --help lists no flags"


STATED_RE = re.compile(r"`((?:" + "|".join(SECTIONS) + r")\.[a-z_.]+):\s*([^`{\[]+)`")


def stated_values():
    """``(file, line, key, value)`` for each ``key: value`` code span (``prompts.gen_schedule: pool|rounds`` gives two);
    placeholders (``N``) left out."""
    for fn, i, line in doc_lines(DOCS + CONFIGS):
        for m in STATED_RE.finditer(line):
            for v in m.group(2).replace("\\|", "|").split("|"):
                v = v.strip()
                if v and not re.fullmatch(r"[A-Z]", v):
                    yield fn, i, m.group(1), v


def test_every_value_the_docs_give_a_key_is_accepted(tmp_path):
    """`train.loss: lk_hybrid`, `extract.storage_dtype: float8_e4m3fn`, `prompts.gen_schedule: pool|rounds`, ...: each
    value the docs write for a key passes the config's own validation (a renamed option fails here)."""
    from eagle3.config import load_config

    stated = list(stated_values())
    assert len(stated) >= 40
    bad = []
    for fn, i, key, value in stated:
        try:
            load_config(ROOT / "configs" / "tiny-llama.yaml", [f"{key}={value}"])
        except Exception as e:  # noqa: BLE001 - the message is the finding
            bad.append(f"{fn}:{i}: `{key}: {value}`: {e}")
    assert not bad, "\n".join(bad)


def test_value_check_refuses_a_wrong_value():
    from eagle3.config import load_config
    from eagle3.errors import UserError

    with pytest.raises(UserError):
        load_config(ROOT / "configs" / "tiny-llama.yaml", ["train.loss=kl"])
    assert ("docs/stages.md", "prompts.gen_schedule", "rounds") in {
        (f, k, v) for f, _, k, v in stated_values()
    }
