"""The package layout (DESIGN.md "Module map"), read from the source with ``ast``.

- ``eagle3/`` holds base modules at the top, concept packages (each one idea, taking plain arguments) and
  ``stages/`` (the five orchestrators). ``LEGACY`` lists the packages the redesign is emptying; none may be added.
- A concept package or base module never imports ``eagle3.stages`` or ``eagle3.cli``.
- ``RunConfig`` (``eagle3.config``, with its section models in ``eagle3.settings.*``) is imported only by ``stages/``,
  ``cli.py``, ``eagle3.config`` itself and the modules still listed in ``KNOWN_CONFIG_USERS`` (which only shrinks).
- A base module may be a package (``eagle3/settings/``, ``eagle3/io/``): its submodules are part of that base module.
- No import cycle between modules. Imports inside functions count: a lazy import is still an arrow.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "eagle3"
BASE = {
    "__init__",
    "config",
    "settings",
    "cli",
    "errors",
    "io",
    "layers",
    "manifest",
    "sdpa",
    "process_group",
}
# the stage manifests are the contract between stages: they import only these eagle3 modules (and pydantic)
MANIFEST_IMPORTS = {"eagle3.io", "eagle3.errors"}
CONCEPTS = {
    "shards",  # shard codec: speculators-v1 sample files, fp8 storage, checksums, manifest log
    "engines",  # engine list, aux layer-id rules, per-engine context rule
    "verifier",  # verifier load, target head, per-architecture facts (arch)
    "chat",  # chat rendering, loss masks
    "drafter",  # EAGLE-3 draft model, attention, decode caches, served config.json round trip
    "losses",  # TTT losses by name: the reference and the fused row kernel
    "data",  # vocab map, dataset, batching
    "capture",  # capture backends (HF, SGLang), shard writer
    "regen",  # regeneration: the slot engine, endpoints, replicas, resume log
    "decoding",  # greedy / speculative decoding for the benchmark
    "export",  # one writer per engine plus a reader
    "train",  # TTT training loop, data order / resume, warm start, checkpoints, report
}
STAGE_PKG = "stages"
LEGACY: set[str] = set()  # packages being emptied into concept packages and stages/
# Modules that still import eagle3.config (RunConfig); each entry leaves when its module takes plain arguments.
KNOWN_CONFIG_USERS: set[str] = set()
# Library modules that still import eagle3.cli; each leaves when its orchestration moves to stages/.
KNOWN_CLI_USERS: set[str] = set()


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def imports_of(mod: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every ``eagle3`` module ``mod`` imports (module level or inside functions), resolved to module names."""
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "eagle3":
                    out.add(a.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "eagle3":
                continue
            for a in node.names:
                sub = f"{target}.{a.name}"
                out.add(sub if sub in modules else target)
    unknown = {m for m in out if m not in modules}
    assert not unknown, f"{path}: imports unknown eagle3 modules {sorted(unknown)}"
    out.discard(mod)
    return out


def import_graph() -> dict[str, set[str]]:
    modules = all_modules()
    return {m: imports_of(m, p, modules) for m, p in modules.items()}


def test_top_level_is_base_concepts_and_stages_only():
    tops = {p.stem for p in PKG.glob("*.py")}
    assert tops <= BASE, f"modules at the top of eagle3/ that are not base: {sorted(tops - BASE)}"
    dirs = {p.name for p in PKG.iterdir() if p.is_dir() and p.name != "__pycache__"}
    rooms = CONCEPTS | LEGACY | {STAGE_PKG} | BASE  # a base module may be a package
    assert dirs <= rooms, sorted(dirs - rooms)
    assert not tops & dirs, f"a module and a package of one name: {sorted(tops & dirs)}"
    for d in dirs:
        assert (PKG / d / "__init__.py").is_file(), d
        names = {p.stem for p in (PKG / d).glob("*.py")}
        assert d not in names, f"eagle3/{d}/{d}.py: a module may not share its package's name"


def is_orchestration(mod: str) -> bool:
    parts = mod.split(".")
    return len(parts) > 1 and parts[1] in {STAGE_PKG, "cli"}


def test_no_library_module_imports_a_stage_or_the_cli():
    bad = [
        f"{m} -> {t}"
        for m, ts in import_graph().items()
        if not is_orchestration(m) and m not in KNOWN_CLI_USERS
        for t in sorted(ts)
        if is_orchestration(t)
    ]
    assert bad == [], "library modules importing stages/ or cli:\n" + "\n".join(bad)


def is_config(mod: str) -> bool:
    """``eagle3.config`` or a section / loader module (``eagle3.settings``): importing any of them is using the run
    config."""
    return mod == "eagle3.config" or mod == "eagle3.settings" or mod.startswith("eagle3.settings.")


def test_runconfig_stays_with_the_stages():
    users = {
        m
        for m, ts in import_graph().items()
        if any(is_config(t) for t in ts) and not is_orchestration(m) and not is_config(m)
    }
    assert users - KNOWN_CONFIG_USERS == set(), (
        f"new RunConfig users: {sorted(users - KNOWN_CONFIG_USERS)}"
    )
    assert KNOWN_CONFIG_USERS - users == set(), (
        f"no longer RunConfig users: remove from KNOWN_CONFIG_USERS: {sorted(KNOWN_CONFIG_USERS - users)}"
    )


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as ``[a, b, ..., a]``, or None (depth-first search, colours white/grey/black)."""
    colour = dict.fromkeys(graph, 0)
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        colour[m] = 1
        stack.append(m)
        for t in sorted(graph[m]):
            if colour[t] == 1:
                return stack[stack.index(t) :] + [t]
            if colour[t] == 0 and (c := visit(t)):
                return c
        stack.pop()
        colour[m] = 2
        return None

    for m in sorted(graph):
        if colour[m] == 0 and (c := visit(m)):
            return c
    return None


def test_manifests_import_only_io_and_errors():
    imported = import_graph()["eagle3.manifest"]
    assert {m for m in imported if not m.startswith("eagle3.io.")} <= MANIFEST_IMPORTS, sorted(
        imported
    )
    tree = ast.parse((PKG / "manifest.py").read_text())
    others = {
        (n.module or "").split(".")[0] if isinstance(n, ast.ImportFrom) else a.name.split(".")[0]
        for n in ast.walk(tree)
        if isinstance(n, (ast.Import, ast.ImportFrom))
        for a in n.names
    }
    assert others <= {"eagle3", "pydantic", "__future__", "os", "pathlib", "typing"}, sorted(others)


def test_no_import_cycle():
    assert find_cycle(import_graph()) is None, " -> ".join(find_cycle(import_graph()))


def test_cycle_finder_and_resolver():
    """The cycle check on a hand-made graph (a -> b -> c -> a is found), and the resolver sees real arrows."""
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(g) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
    assert is_orchestration("eagle3.stages.train") and is_orchestration("eagle3.cli")
    assert not is_orchestration("eagle3.train.loop")
    g = import_graph()
    assert "eagle3.capture.hf" in g["eagle3.train.online"]  # including imports inside functions


def test_test_basenames_are_unique():
    """tests/conftest.py puts every tests/<stage>/ folder on sys.path (helpers are shared by module name),
    so two test files with one basename would shadow each other."""
    names = [p.name for p in (ROOT / "tests").rglob("*.py") if "__pycache__" not in p.parts]
    assert sorted(n for n in set(names) if names.count(n) > 1) == []


# ---- orchestration is a sequence of named steps (issue 24: no function over ~80 lines) -------------------
MAX_FUNCTION_LINES = 80
ORCHESTRATION = [
    "eagle3/stages/benchmark.py",
    "eagle3/stages/export.py",
    "eagle3/stages/extract.py",
    "eagle3/stages/prepare_data.py",
    "eagle3/stages/prepare_prompts.py",
    "eagle3/stages/train.py",
    "eagle3/regen/regen_server.py",
    "eagle3/regen/regenerate.py",
    "eagle3/regen/replicas.py",
    "eagle3/regen/slots.py",
    "eagle3/regen/slot_prefill.py",
    "eagle3/regen/slot_decode.py",
    "eagle3/train/inputs.py",
    "eagle3/train/loop.py",
    "eagle3/train/order.py",
]
# Known long functions, owned by the redesign (issue 50: no function over 60 lines); the owner removes the entry when the function is split
# (this test fails both for a new long function and for an entry whose function is no longer long).
KNOWN_LONG: set[str] = set()


def long_functions(
    path: Path, limit: int = MAX_FUNCTION_LINES, root: Path = ROOT
) -> dict[str, int]:
    """``{"<path>::<qualname>": lines}`` for every function / method of ``path`` longer than ``limit`` lines
    (``def`` line to last line, decorators excluded, nested functions counted inside their parent too)."""
    out: dict[str, int] = {}

    def walk(node, prefix: str) -> None:
        for ch in ast.iter_child_nodes(node):
            if isinstance(ch, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{ch.name}"
                if not isinstance(ch, ast.ClassDef) and ch.end_lineno - ch.lineno + 1 > limit:
                    out[f"{path.relative_to(root).as_posix()}::{name}"] = (
                        ch.end_lineno - ch.lineno + 1
                    )
                walk(ch, name + ".")

    walk(ast.parse(path.read_text(), filename=str(path)), "")
    return out


def test_orchestration_functions_are_short():
    found: dict[str, int] = {}
    for rel in ORCHESTRATION:
        found.update(long_functions(ROOT / rel))
    new = {k: v for k, v in found.items() if k not in KNOWN_LONG}
    assert new == {}, (
        f"functions over {MAX_FUNCTION_LINES} lines (split them into named steps): {new}"
    )
    gone = sorted(KNOWN_LONG - found.keys())
    assert gone == [], (
        f"no longer over {MAX_FUNCTION_LINES} lines: remove from KNOWN_LONG in tests/test_layout.py: {gone}"
    )


def test_long_function_finder_counts_lines(tmp_path):
    """80 lines pass, 81 do not; methods are named ``Class.method`` and nested functions are seen."""

    def body(n: int, indent: str) -> str:
        return "\n".join(f"{indent}x{i} = {i}" for i in range(n))

    f = tmp_path / "probe.py"
    f.write_text(
        f"def short():\n{body(79, '    ')}\n\n\nclass C:\n    def long(self):\n{body(80, '        ')}\n\n\n"
        f"def outer():\n    def inner():\n{body(80, '        ')}\n    return inner\n"
    )
    assert long_functions(f, root=tmp_path) == {
        "probe.py::C.long": 81,
        "probe.py::outer": 83,
        "probe.py::outer.inner": 81,
    }
    assert long_functions(f, limit=83, root=tmp_path) == {}
