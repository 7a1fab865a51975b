"""Read functions out of the installed SGLang source without importing SGLang.

``import sglang`` needs SGLang's full dependency set (orjson, fastapi, CUDA kernels...). CI installs
SGLang 0.5.23 with ``pip install --no-deps`` only, so tests (and the launcher's self-check) locate
the package with ``importlib.util.find_spec`` (which does not execute ``sglang/__init__.py``) and
extract individual ``def`` nodes with :mod:`ast`. A pure function (e.g. a model's
``set_eagle3_layers_to_capture``) can then be compiled on its own and run against stand-in
objects: that executes SGLang's real code for the rule under test.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import textwrap
from pathlib import Path
from typing import Any, Callable, Optional


def sglang_root() -> Optional[Path]:
    """The installed ``sglang`` package folder, or None when SGLang is not installed (nothing imported)."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def installed_version() -> Optional[str]:
    """The installed SGLang distribution version (``importlib.metadata``, no import), or None."""
    from importlib import metadata

    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return None


def find_def(path: str | Path, qualname: str) -> ast.FunctionDef:
    """The ``def`` node for ``qualname`` (``"func"`` or ``"Class.method"``) in a Python file.

    Raises:
        LookupError: the file has no such function/method.
    """
    tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    parts = qualname.split(".")
    body = tree.body
    node: Any = None
    for i, name in enumerate(parts):
        want = (ast.FunctionDef, ast.AsyncFunctionDef) if i == len(parts) - 1 else (ast.ClassDef,)
        node = next((n for n in body if isinstance(n, want) and n.name == name), None)
        if node is None:
            raise LookupError(
                f"{path}: no {'def' if i == len(parts) - 1 else 'class'} '{'.'.join(parts[: i + 1])}'"
            )
        body = node.body
    return node


def def_source(path: str | Path, qualname: str) -> str:
    """The exact source text of a function/method (dedented), decorators excluded."""
    node = find_def(path, qualname)
    lines = Path(path).read_text(encoding="utf-8").splitlines(keepends=True)
    return textwrap.dedent("".join(lines[node.lineno - 1 : node.end_lineno]))


def def_fingerprint(path: str | Path, qualname: str) -> str:
    """sha256 (first 16 hex) of a function's source: detects any upstream change to a patched function."""
    return hashlib.sha256(def_source(path, qualname).encode("utf-8")).hexdigest()[:16]


def arg_names(path: str | Path, qualname: str) -> dict[str, list[str]]:
    """``{"args": [...], "kwonly": [...]}`` of a function/method in the source file."""
    a = find_def(path, qualname).args
    return {
        "args": [x.arg for x in a.posonlyargs + a.args],
        "kwonly": [x.arg for x in a.kwonlyargs],
    }


def compile_def(path: str | Path, qualname: str, namespace: Optional[dict] = None) -> Callable:
    """Compile one function from the SGLang source in ``namespace`` (its globals) and return it.

    Annotations are dropped (SGLang's type names need not exist in ``namespace``); the body runs
    unchanged, so any global it uses must be provided in ``namespace``.
    """
    node = find_def(path, qualname)
    node = ast.fix_missing_locations(node)
    node.decorator_list = []
    node.returns = None
    for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs:
        a.annotation = None
    if node.args.vararg:
        node.args.vararg.annotation = None
    if node.args.kwarg:
        node.args.kwarg.annotation = None
    mod = ast.Module(body=[node], type_ignores=[])
    ns = dict(namespace or {})
    exec(compile(mod, f"{path}::{qualname}", "exec"), ns)  # noqa: S102 - SGLang's own, installed source
    return ns[node.name]


def compile_class(path: str | Path, name: str, namespace: Optional[dict] = None) -> type:
    """Compile one top-level class from a source file in ``namespace`` (e.g. SGLang's ``CaptureHiddenMode``)."""
    tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    node = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name), None)
    if node is None:
        raise LookupError(f"{path}: no class '{name}'")
    ns = dict(namespace or {})
    exec(compile(ast.Module(body=[node], type_ignores=[]), f"{path}::{name}", "exec"), ns)  # noqa: S102
    return ns[name]


def load_file_module(path: str | Path, name: str):
    """Import one SGLang source file as a standalone module (only for files whose imports are
    satisfied without SGLang's dependencies, e.g. ``srt/layers/aux_hidden_states.py``)."""
    spec = importlib.util.spec_from_file_location(name, str(path))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
