"""05 ``--server``'s checks of the servers against the run, taking plain arguments: the server's speculative algorithm
(refused when it cannot serve an EAGLE-3 drafter), the draft folder an SGLang or vLLM server was started with (when
it names it and the folder is readable here) against the shards and the configured verifier, and each server's
``model_path`` against the configured verifier. Each returns ``(warning lines, record)``; the record's
``not_checked`` lists the checks that could not be made and how to make them.

Where each engine reports its settings: SGLang 0.5.23 ``GET /server_info`` (its resolved server args:
``speculative_algorithm``, ``speculative_draft_model_path``, ``speculative_num_steps``); vLLM 0.32 only with
``VLLM_SERVER_DEV_MODE=1``, at ``GET /server_info?config_format=json`` (``vllm_config.speculative_config``:
``method``, ``model``, ``num_speculative_tokens``), else its draft steps alone, from ``/metrics``
(:func:`eagle3.decoding.server.vllm_server_info`)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from eagle3.chat.template import ChatOptions
from eagle3.decoding.checks import (
    template_check,
    template_kwargs_check,
    ttt_length_check,
    verifier_check,
)
from eagle3.decoding.server import served_model_path, server_info
from eagle3.engines import LABELS
from eagle3.errors import UserError
from eagle3.export.common import WEIGHTS_FILE
from eagle3.export.reader import check_export_folder, preflight_export
from eagle3.io.read import file_sha256
from eagle3.shards.data_config import read_data_config
from eagle3.shards.format import DATA_CONFIG
from eagle3.verifier.hf_folder import SOURCE_FILE, source_weights
from eagle3.verifier.load import weights_fingerprint

#: per engine: the server setting that names the draft steps, where the algorithm is reported, the algorithm an
#: EAGLE-3 drafter needs, the algorithms that serve none (their draft captures no aux hidden states: tau ~1.0; SGLang
#: 0.5.23 resolves NEXTN to EAGLE) and the flag to relaunch with (``{draft}``, ``{steps}`` filled in)
ENGINE_FLAGS = {
    "sglang": {
        "steps": "--speculative-num-steps",
        "algorithm_field": "speculative_algorithm",
        "eagle3": "EAGLE3",
        "refused": ("EAGLE", "NEXTN"),
        "relaunch": "--speculative-algorithm EAGLE3",
    },
    "vllm": {
        "steps": "num_speculative_tokens (--speculative-config)",
        "algorithm_field": "speculative_config.method",
        "eagle3": "eagle3",
        "refused": ("eagle",),
        "relaunch": '--speculative-config \'{{"method": "eagle3", "model": "{draft}", '
        '"num_speculative_tokens": {steps}}}\'',
    },
}


def draft_folder_warnings(
    url: str,
    verifier_name: str,
    weights: Optional[str],
    shards_dir: Path,
    timeout: float = 30.0,
    export_dir: Optional[Path] = None,
) -> tuple[list[str], dict]:
    """Check the draft folder a server names (SGLang ``/server_info`` ``speculative_draft_model_path``, vLLM's
    ``speculative_config.model``) when readable here: refuse an export for the other engine, warn on captured layers
    other than the shards', on more draft steps than the drafter's ``ttt_length``, on another verifier, on weights
    other than those of the run's ``export_dir`` for the same engine (:func:`_export_lines`). When the folder is not
    readable or not named, one warning says which checks were not made.

    Returns:
        ``(warnings, record)``: ``record`` = ``{"url", "engine", "path", "speculative_num_steps", "readable",
        "not_checked"}``, and ``same_weights_as_export`` when compared (``server_bench.json`` key ``draft_folder``).

    Raises:
        UserError: the folder is for the other engine or its layer ids contradict its metadata.
    """
    info = server_info(url, timeout)
    engine = info.get("engine", "sglang")
    path, steps = info.get("speculative_draft_model_path"), info.get("speculative_num_steps")
    steps = steps if isinstance(steps, int) and not isinstance(steps, bool) else None
    rec = {
        "url": url,
        "engine": engine,
        "path": path,
        "speculative_num_steps": steps,
        "readable": False,
        "not_checked": [],
    }
    unread = _unreadable_draft_folder(url, info, path, steps)
    if unread is not None:
        if unread:
            rec["not_checked"].append(unread)
        return [unread] if unread else [], rec
    rec["readable"] = True
    out = _noted(rec, verifier_check(Path(path), verifier_name, None, weights, dims_checked=False))
    out += _steps_lines(url, Path(path), steps, rec, engine)
    out += _export_lines(url, Path(path), export_dir, engine, rec)
    return out + _folder_lines(path, shards_dir, rec, engine), rec


def _export_lines(
    url: str, path: Path, export_dir: Optional[Path], engine: str, rec: dict
) -> list[str]:
    """For :func:`draft_folder_warnings`: the served folder's ``model.safetensors`` against the run's export of the
    same engine (sha256; not compared when ``export_dir`` is None, not an export here, or for the other engine):
    the warning line when they differ, ``rec["same_weights_as_export"]`` when compared."""
    if export_dir is None or Path(export_dir).resolve() == path.resolve():
        if export_dir is not None:
            rec["same_weights_as_export"] = True
        return []
    mine, theirs = Path(export_dir) / WEIGHTS_FILE, path / WEIGHTS_FILE
    try:
        if check_export_folder(export_dir)["engine"] != engine or not (
            theirs.is_file() and mine.is_file()
        ):
            return []
    except UserError:  # no export of this run here
        return []
    rec["same_weights_as_export"] = file_sha256(mine) == file_sha256(theirs)
    if rec["same_weights_as_export"]:
        return []
    return [
        f"{url}: the server's draft folder {path} holds other weights than the run's export {export_dir} "
        f"({theirs} and {mine} differ): 05 measures the served drafter, not this run's; serve {export_dir}, or "
        f"check that {path} is the drafter you mean to measure"
    ]


def _steps_lines(url: str, path: Path, steps: Optional[int], rec: dict, engine: str) -> list[str]:
    """For :func:`draft_folder_warnings`: the server's draft steps against the folder's ``ttt_length`` (the warning
    line, or none; what was not checked goes to ``rec["not_checked"]``)."""
    flag = ENGINE_FLAGS[engine]["steps"]
    if steps is None:
        rec["not_checked"].append(
            f"{url}/server_info names no integer speculative_num_steps: 05 did not check the "
            f"drafter's trained ttt_length ({path / 'eagle3_train.json'}) against the "
            f"draft tokens the server drafts a step; check that its {flag} is "
            f"at most that ttt_length"
        )
        return []
    if engine == "vllm":
        field = f"the server's num_speculative_tokens (--speculative-config, {url}/server_info)"
        fix = "restart the server with num_speculative_tokens {k} in --speculative-config"
    else:
        field = f"the server's speculative_num_steps (--speculative-num-steps, {url}/server_info)"
        fix = "restart the server with --speculative-num-steps {k}"
    return _noted(
        rec, ttt_length_check(path, steps, field, fix=fix, unchecked_field=f"the server's {flag}")
    )


def _folder_lines(path: str, shards_dir: Path, rec: dict, engine: str = "sglang") -> list[str]:
    """The readable folder's engine and layer lines, then every line of ``rec["not_checked"]``.

    Raises:
        UserError: as :func:`eagle3.export.reader.check_export_folder`.
    """
    if not (Path(path) / "config.json").is_file():
        rec["not_checked"].append(
            f"{Path(path) / 'config.json'} not found: 05 did not check the folder's engine and "
            f"aux layers; check that the server loads a folder with one"
        )
        return rec["not_checked"]
    shards_aux = arch = None
    if (Path(shards_dir) / DATA_CONFIG).is_file():
        dc = read_data_config(shards_dir)
        shards_aux, arch = dc.get("aux_layers"), dc.get("architecture")
    else:
        rec["not_checked"].append(
            f"{Path(shards_dir) / DATA_CONFIG} not found: 05 checked the layers {LABELS[engine]} "
            f"captures against the folder's own record only, not against the shards'; compare "
            f"its eagle3_train.json aux_layers_hf with the shards' data_config.json aux_layers"
        )
    warnings = check_export_folder(
        path, serving_engine=engine, shards_aux_hf=shards_aux, verifier_architecture=arch
    )["warnings"]
    return warnings + rec["not_checked"]


def _noted(rec: dict, check: tuple[Optional[str], Optional[str]]) -> list[str]:
    """A ``(warning, not_checked)`` check of :mod:`eagle3.decoding.checks`: its not-checked line appended to
    ``rec["not_checked"]``; returns ``[warning]`` or ``[]``."""
    warning, unchecked = check
    rec["not_checked"] += [unchecked] if unchecked else []
    return [warning] if warning else []


def _unreadable_draft_folder(url: str, info: dict, path, steps: Optional[int]) -> Optional[str]:
    """For :func:`draft_folder_warnings`: None when the server's draft folder is readable here; ``""`` for a server
    that says it does not speculate (``run_server_bench`` warns about that); else the warning line naming what was not
    checked and how to check it."""
    if info.get("engine") == "vllm":
        return _unreadable_vllm_draft_folder(url, info, path, steps)
    if not info:
        why = f"{url}/server_info did not answer (not SGLang, or an older one), so the server's draft folder is unknown"
    elif not path:
        if info.get("speculative_algorithm") in (None, "", "NONE"):
            return ""
        why = f"{url}/server_info names no speculative_draft_model_path"
    elif not isinstance(path, str):  # a proxy's or hand-made server_info: Path() raised TypeError
        why = f"{url}/server_info speculative_draft_model_path is {path!r}, not a folder path"
    elif not Path(path).is_dir():
        why = (
            f"the server's draft folder {path} ({url}/server_info speculative_draft_model_path) is not readable on "
            f"this machine (the server runs elsewhere, or it is a hub id)"
        )
    else:
        return None
    k = f" {steps}" if steps is not None else ""
    return (
        f"{why}: 05 did not check it against the server (its eagle3_train.json ttt_length against "
        f"--speculative-num-steps{k}, its config.json's engine (sglang) and aux layers against the shards'); run 05 "
        f"where that folder is readable (e.g. on shared storage), or check there that its eagle3_train.json has "
        f"engine sglang and ttt_length >= the server's --speculative-num-steps"
    )


def _unreadable_vllm_draft_folder(
    url: str, info: dict, path, steps: Optional[int]
) -> Optional[str]:
    """:func:`_unreadable_draft_folder` for a vLLM server (``info`` from
    :func:`eagle3.decoding.server.vllm_server_info`)."""
    k = f" {steps}" if steps is not None else ""
    if not info.get("server_info"):
        if "speculative_num_steps" not in info:  # no spec-decode counters either: a plain server
            return ""
        why = (
            f"{url}/server_info did not answer (vLLM serves it only when started with VLLM_SERVER_DEV_MODE=1), so "
            f"the server's speculative method and draft folder are unknown"
        )
    elif not path:
        if not info.get("speculative_algorithm"):
            return ""
        why = f"{url}/server_info speculative_config names no model"
    elif not isinstance(path, str) or not Path(path).is_dir():
        why = (
            f"the server's draft folder {path!r} ({url}/server_info speculative_config.model) is not readable on "
            f"this machine (the server runs elsewhere, or it is a hub id)"
        )
    else:
        return None
    return (
        f"{why}: 05 did not check it against the server (its method against eagle3, its eagle3_train.json "
        f"ttt_length against num_speculative_tokens{k}, its config.json's engine (vllm) and aux layers against the "
        f"shards'); start the server with VLLM_SERVER_DEV_MODE=1 and run 05 where its draft folder is readable, or "
        f"check that its --speculative-config has method eagle3, a drafter-vllm folder and num_speculative_tokens "
        f"at most that folder's eagle3_train.json ttt_length"
    )


def _verifier_where(vcfg) -> tuple[Optional[Path], str]:
    """The configured verifier's weights on this machine (its folder, or its GGUF file) and how to name it."""
    try:
        folder = vcfg.resolved_path()
    except UserError:  # a package: path whose package is not installed here
        return None, vcfg.path
    where = folder / vcfg.gguf_file if vcfg.gguf_file else folder
    return where, str(where)


def compare_served_model(vcfg, served: str) -> tuple[Optional[str], str]:
    """Whether ``served`` (a server's ``model_path``) is the configured verifier ``vcfg``.

    Returns:
        ``(verdict, detail)``: ``"same folder"`` | ``"same weights"`` (fingerprint) | ``"differs"``
        when readable here, else ``"same name"`` (last path component, case-insensitive) or None.
    """
    mine, _ = _verifier_where(vcfg)
    sp = Path(served)
    if mine is not None and sp.exists():
        if sp.resolve() == mine.resolve():
            return "same folder", "the same path"
        folder, gguf = (sp.parent, sp.name) if sp.is_file() else (sp, None)
        theirs = weights_fingerprint(
            vcfg.model_copy(update={"path": str(folder), "gguf_file": gguf})
        )
        ours = weights_fingerprint(vcfg)
        if ours and sp.is_dir() and source_weights(sp) == ours:
            return "same weights", f"written from verifier.path's weights ({SOURCE_FILE})"
        if theirs and theirs == ours:
            return "same weights", "a copy of its weight files"
        if theirs and ours:
            why = "its weight files are not those at verifier.path (verifier_weights fingerprints differ)"
            return "differs", why
    mine_name = mine.name if mine is not None else None
    names = {
        n.lower() for n in (mine_name, vcfg.gguf_file, vcfg.name and Path(vcfg.name).name) if n
    }
    name = sp.name.lower() or served.lower()
    if name in names:
        return "same name", f"the same name {sp.name!r}"
    where = (
        "its weights could not be fingerprinted here"
        if sp.exists()
        else "it is not readable on this machine"
    )
    return (
        None,
        f"{where} and its name {sp.name!r} is not verifier.path's ({', '.join(sorted(names))})",
    )


def served_model_warnings(
    vcfg, urls: Sequence[str], timeout: float = 30.0
) -> tuple[list[str], list[dict]]:
    """Check that each server runs the configured verifier ``vcfg`` (:func:`compare_served_model`):
    other weights, or a ``model_path`` that cannot be confirmed, give one warning line each.

    Returns:
        ``(warnings, records)``: per URL ``{"url", "model_path", "endpoint", "verifier", "match",
        "not_checked"}`` (``server_bench.json`` key ``served_model``).
    """
    out, recs = [], []
    _, where = _verifier_where(vcfg)
    name = vcfg.display_name()
    tail = f"05 renders the prompts with the tokenizer and chat template of verifier '{name}' ({where})"
    for url in urls:
        served, endpoint = served_model_path(url, timeout)
        rec = {
            "url": url,
            "model_path": served,
            "endpoint": endpoint,
            "verifier": name,
            "match": None,
            "not_checked": [],
        }
        if served is None:
            rec["not_checked"].append(
                f"{url}: none of /server_info, /model_info, /get_model_info names the served model_path (not "
                f"SGLang?): 05 did not check that the server runs the configured verifier; {tail}: check that the "
                f"server was started with --model-path {where}"
            )
        else:
            rec["match"], detail = compare_served_model(vcfg, served)
            if rec["match"] == "differs":
                out.append(
                    f"{url}{endpoint} model_path {served} is not the configured verifier: {detail}; {tail}, so "
                    f"tau measures a server of another model: benchmark a server started with --model-path "
                    f"{where}, or set verifier.path to the served model"
                )
            elif rec["match"] is None:
                rec["not_checked"].append(
                    f"{url}{endpoint} model_path {served}: {detail}, so 05 could not "
                    f"check that the server runs the configured verifier; {tail}: check that the server's "
                    f"--model-path holds the model at {where}"
                )
        out += rec["not_checked"]
        recs.append(rec)
    return out, recs


def check_speculative_algorithm(url: str, info: dict, export_dir: Optional[Path] = None) -> None:
    """Refuse a server whose speculative algorithm serves no EAGLE-3 drafter (:data:`ENGINE_FLAGS` ``refused``:
    SGLang's ``EAGLE`` / ``NEXTN``, vLLM's ``eagle``: their draft captures no aux hidden states, so an EAGLE-3
    drafter accepts almost nothing, without an error); ``info``: its :func:`eagle3.decoding.server.server_info`
    (no algorithm: not checked). ``export_dir``: the run's export, whose method the line names when the server's
    own draft folder is not readable here.

    Raises:
        UserError: one line naming the server's algorithm, the export's method and the flag to relaunch with.
    """
    engine = info.get("engine", "sglang")
    flags = ENGINE_FLAGS[engine]
    algo = info.get("speculative_algorithm")
    if not isinstance(algo, str) or algo.upper() not in {a.upper() for a in flags["refused"]}:
        return
    served = info.get("speculative_draft_model_path")
    folder = next(
        (Path(p) for p in (served, export_dir) if isinstance(p, (str, Path)) and Path(p).is_dir()),
        None,
    )
    steps = info.get("speculative_num_steps") or "K"
    relaunch = flags["relaunch"].format(draft=served or folder or "DRAFT", steps=steps)
    raise UserError(
        f"{url}/server_info {flags['algorithm_field']} is {algo!r}, but {export_method(folder)} needs "
        f"{flags['eagle3']!r} ({LABELS[engine]}'s {algo} path captures no aux hidden states: tau ~1.0); restart the "
        f"server with {relaunch}"
    )


def export_method(folder: Optional[Path]) -> str:
    """The EAGLE-3 method of an export folder in words: ``the export DIR (method eagle3, variant eagle3.1)``; the
    variant from its ``config.json`` (:func:`eagle3.export.reader.preflight_export`), ``an EAGLE-3 drafter`` when the
    folder is None or not readable as an export."""
    if folder is None:
        return "an EAGLE-3 drafter"
    try:
        variant = preflight_export(folder)[2].variant
    except UserError:
        return "an EAGLE-3 drafter"
    return f"the export {folder} (method eagle3, variant {variant})"


def check_servers(
    urls: Sequence[str],
    vcfg,
    shards_dir: Path,
    tokenizer,
    chat: ChatOptions,
    export_dir: Optional[Path] = None,
) -> tuple[list[str], dict]:
    """05 ``--server``'s checks: each server's speculative algorithm (:func:`check_speculative_algorithm`; the run's
    ``export_dir`` named in its refusal), draft folder, each server's model, the chat template against the shards'.
    Returns ``(warning lines, {"not_checked", "draft_folder", "served_model"})``.
    """
    for url in urls:
        check_speculative_algorithm(url, server_info(url), export_dir)
    name, fp = vcfg.display_name(), weights_fingerprint(vcfg)
    notes, folder = draft_folder_warnings(urls[0], name, fp, shards_dir, export_dir=export_dir)
    model_notes, served = served_model_warnings(vcfg, urls)
    template = (
        template_check(shards_dir, tokenizer, chat, say_missing=True),
        template_kwargs_check(shards_dir, vcfg.chat_template_kwargs),
    )
    notes += model_notes + [w for pair in template for w in pair if w]
    unchecked = folder["not_checked"] + [w for r in served for w in r["not_checked"]]
    return notes, {
        "not_checked": unchecked + [u for _, u in template if u],
        "draft_folder": folder,
        "served_model": served,
    }
