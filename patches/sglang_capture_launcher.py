#!/usr/bin/env python
"""Launch SGLang 0.5.23 with the EAGLE-3 capture patch (hidden states to files, not JSON).

Usage (see patches/README.md for the full, tested-flag command):

    python patches/sglang_capture_launcher.py --capture-dir /dev/shm/eagle3-capture \\
        --model-path /models/Kimi-K2.5 --trust-remote-code --tp-size 8 \\
        --enable-return-aux-hidden-states --speculative-algorithm EAGLE3 \\
        --return-aux-hidden-state-layer-ids 3 31 59 \\
        --disable-radix-cache --chunked-prefill-size -1 --disable-overlap-schedule

Every argument except the launcher's own ``--capture-dir DIR`` and optional ``--max-length N`` (the run's
``extract.max_length``; accepted for older command lines, no longer needed: chunked prefill must be off whatever the
prompt length, see :func:`check_server_flags`) goes to SGLang's own server entry point
(``sglang.launch_server``: ``load_plugins(); prepare_server_args(argv); run_server(...)``).

How the patch reaches the workers: SGLang sets the multiprocessing start method to ``spawn``
(``srt/entrypoints/engine.py``), and a spawned child re-imports the parent's main script as
``__mp_main__`` before running its target. The patch is therefore applied at import time of
this file (module level, below), in the launcher and again in every scheduler process, and
the capture folder travels in the inherited environment variable ``EAGLE3_CAPTURE_DIR``.
Importing this file as a module elsewhere (tests) does not patch anything: the import-time
hook only fires when this file is the main script (``__main__`` / ``__mp_main__``).

Patched (SGLang 0.5.23 only; any other version is refused):
  1. ``SchedulerBatchResultProcessor._append_prefill_hidden_states``
     (srt/managers/scheduler_components/batch_result_processor.py): full-capture prefill rows
     -> ``{capture_dir}/{rid}.pt`` via ``eagle3_capture.store_prefill_capture``.
  2. ``GenerationBatchResult.copy_to_cpu`` (srt/managers/utils.py): also queue the host copy of
     ``last_hidden_states`` before the ``copy_done`` event.
  3. ``configure_aux_hidden_state_capture`` (srt/model_executor/model_runner_components/
     attention_backend_setup.py, and its imported name in srt/model_executor/model_runner.py):
     afterwards record ``layers_to_capture`` and write ``capture_info.json``.
``sglang-0.5.23-capture.diff`` is the same change as a source diff.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
import eagle3_capture  # noqa: E402  (the writer; same file the diff adds to SGLang)

REQUIRED_VERSION = "0.5.23"

#: (module, qualified attribute) of every symbol the patch replaces.
PATCH_TARGETS = (
    (
        "sglang.srt.managers.scheduler_components.batch_result_processor",
        "SchedulerBatchResultProcessor._append_prefill_hidden_states",
    ),
    ("sglang.srt.managers.utils", "GenerationBatchResult.copy_to_cpu"),
    (
        "sglang.srt.model_executor.model_runner_components.attention_backend_setup",
        "configure_aux_hidden_state_capture",
    ),
    ("sglang.srt.model_executor.model_runner", "configure_aux_hidden_state_capture"),
)

#: Server flags the capture needs (flag -> why). Checked on the raw argv before SGLang starts.
REQUIRED_FLAGS = {
    "--enable-return-aux-hidden-states": "capture aux states on the target without a draft model",
    "--disable-radix-cache": "a cached prefix is not recomputed, so its states would never be captured",
    "--chunked-prefill-size": "must be -1 (chunked prefill off): SGLang stores only the last chunk's states, and it "
    "chunks any request that overflows a prefill batch's shared chunk budget",
}
#: Flags that break the one-request-one-prefill assumption.
FORBIDDEN_FLAGS = {
    "--enable-dp-attention": "attention data parallelism splits request rows over ranks (untested with the writer)",
    "--enable-two-batch-overlap": "two-batch overlap splits a prefill batch into micro-batches",
    "--pp-size": "--enable-return-aux-hidden-states requires pp_size == 1",
}


class LaunchError(Exception):
    """Bad launcher usage or an unsupported SGLang install (message = one line)."""


def check_version(installed: Optional[str]) -> None:
    """Refuse any SGLang but 0.5.23: the patched functions are private and change between releases.

    Raises:
        LaunchError: not installed, or another version.
    """
    if installed is None:
        raise LaunchError("SGLang is not installed (pip install sglang==0.5.23)")
    if installed != REQUIRED_VERSION:
        raise LaunchError(
            f"this patch is for sglang=={REQUIRED_VERSION}, found {installed}; "
            "port patches/sglang-0.5.23-capture.diff before using another version"
        )


def split_args(argv: list[str]) -> tuple[str, Optional[int], list[str]]:
    """Take the launcher's own ``--capture-dir DIR`` and optional ``--max-length N`` out of ``argv``.

    Both also accept ``--flag=value``. The rest is SGLang's argv, passed through unchanged.

    Returns:
        ``(capture_dir, max_length or None, sglang_argv)``.

    Raises:
        LaunchError: ``--capture-dir`` missing, or a launcher flag without a (valid) value.
    """
    ours: dict[str, Optional[str]] = {"--capture-dir": None, "--max-length": None}
    rest: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        name = a.split("=", 1)[0]
        if name in ours:
            if "=" in a:
                ours[name] = a.split("=", 1)[1]
                i += 1
            else:
                if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                    raise LaunchError(f"{name} needs a value")
                ours[name] = argv[i + 1]
                i += 2
            continue
        rest.append(a)
        i += 1
    if not ours["--capture-dir"]:
        raise LaunchError("--capture-dir DIR is required (where the server writes <rid>.pt)")
    max_len = None
    if ours["--max-length"] is not None:
        try:
            max_len = int(ours["--max-length"])
        except ValueError:
            raise LaunchError(
                f"--max-length must be an integer, got {ours['--max-length']!r}"
            ) from None
    return ours["--capture-dir"], max_len, rest


def _flag_value(argv: list[str], flag: str) -> Optional[str]:
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def check_server_flags(argv: list[str], max_length: Optional[int] = None) -> None:
    """Check the SGLang argv for the flags the capture needs (README.md explains each).

    ``--chunked-prefill-size`` must be -1 (chunked prefill off), whatever the prompt length: SGLang 0.5.23's
    ``PrefillAdder`` (``srt/managers/schedule_policy.py`` ``_select_prefill_admission``) gives each prefill batch
    ONE chunk budget of ``chunked_prefill_size`` tokens shared by its requests, and chunks the request that
    overflows what is left (``chunk_fit_tokens > chunk_tokens_limit``). With several prompts in flight (a
    ``/generate`` batch of ``extract.batch_tokens``) a prompt far shorter than the budget is split too, and a
    split prompt's earlier chunks are never stored (the patch then writes ``<rid>.error.json``).

    Args:
        max_length: the run's ``extract.max_length`` (accepted for older callers; the check no longer needs it).

    Raises:
        LaunchError: a required flag is missing, a forbidden one is present, or chunked prefill is on.
    """
    present = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    for flag, why in REQUIRED_FLAGS.items():
        if flag not in present:
            raise LaunchError(f"missing server flag {flag}: {why}")
    for flag, why in FORBIDDEN_FLAGS.items():
        if flag in present and not (flag == "--pp-size" and _flag_value(argv, flag) == "1"):
            raise LaunchError(f"server flag {flag} is not supported by the capture: {why}")
    algo = (_flag_value(argv, "--speculative-algorithm") or "").upper()
    if algo != "EAGLE3":
        raise LaunchError(
            "missing --speculative-algorithm EAGLE3: with --enable-return-aux-hidden-states it "
            "names the capture convention (EAGLE3 layer ids, set_eagle3_layers_to_capture)"
        )
    chunk = _flag_value(argv, "--chunked-prefill-size")
    try:
        chunk_i = int(chunk)
    except (TypeError, ValueError):
        raise LaunchError(f"--chunked-prefill-size must be an integer, got {chunk!r}") from None
    if chunk_i > 0:
        raise LaunchError(
            f"--chunked-prefill-size {chunk_i}: use -1 (chunked prefill off). SGLang shares one chunk "
            f"budget of {chunk_i} tokens among the prompts of a prefill batch and splits the prompt that "
            "overflows it, however short; a split prompt's earlier chunks are never captured"
        )


# ---- the replacements ------------------------------------------------------------------------
def make_append_prefill_hidden_states(original):
    """Wrap SGLang's ``_append_prefill_hidden_states``: full-capture rows of ``return_hidden_states=True``
    requests go to files while the capture is enabled; every other case runs the original."""

    @functools.wraps(original)
    def _append_prefill_hidden_states(
        self,
        *,
        req,
        logits_output,
        hidden_state_offset,
        capture_hidden_mode,
        extend_input_len,
        store=True,
    ):
        if (
            capture_hidden_mode.is_full()
            and eagle3_capture.enabled()
            and req.return_hidden_states is True
        ):
            return eagle3_capture.store_prefill_capture(
                req=req,
                logits_output=logits_output,
                start=hidden_state_offset,
                extend_input_len=extend_input_len,
                store=store,
            )
        return original(
            self,
            req=req,
            logits_output=logits_output,
            hidden_state_offset=hidden_state_offset,
            capture_hidden_mode=capture_hidden_mode,
            extend_input_len=extend_input_len,
            store=store,
        )

    _append_prefill_hidden_states.__eagle3_patched__ = True
    return _append_prefill_hidden_states


def make_copy_to_cpu(original, d2h):
    """Wrap ``GenerationBatchResult.copy_to_cpu``: queue ``last_hidden_states``' host copy first
    (same stream, before the original records ``copy_done``)."""

    @functools.wraps(original)
    def copy_to_cpu(self, return_logprob, return_hidden_states=True):
        eagle3_capture.copy_last_hidden_states(self, return_hidden_states, d2h)
        return original(self, return_logprob, return_hidden_states)

    copy_to_cpu.__eagle3_patched__ = True
    return copy_to_cpu


def make_configure_aux(original):
    """Wrap ``configure_aux_hidden_state_capture``: afterwards record the captured layers."""

    @functools.wraps(original)
    def configure_aux_hidden_state_capture(*, model, eagle_use_aux_hidden_state, **kwargs):
        out = original(model=model, eagle_use_aux_hidden_state=eagle_use_aux_hidden_state, **kwargs)
        if eagle_use_aux_hidden_state:
            eagle3_capture.record_capture_layers(model)
        return out

    configure_aux_hidden_state_capture.__eagle3_patched__ = True
    return configure_aux_hidden_state_capture


def apply_patch() -> None:
    """Import SGLang 0.5.23 and monkeypatch the three functions (idempotent).

    Raises:
        LaunchError: wrong SGLang version.
    """
    import importlib
    from importlib import metadata

    try:
        check_version(metadata.version("sglang"))
    except metadata.PackageNotFoundError:
        check_version(None)
    import sglang

    check_version(getattr(sglang, "__version__", None))
    brp = importlib.import_module(PATCH_TARGETS[0][0])
    utils = importlib.import_module(PATCH_TARGETS[1][0])
    abs_mod = importlib.import_module(PATCH_TARGETS[2][0])
    mr = importlib.import_module(PATCH_TARGETS[3][0])
    cls = brp.SchedulerBatchResultProcessor
    if not getattr(cls._append_prefill_hidden_states, "__eagle3_patched__", False):
        cls._append_prefill_hidden_states = make_append_prefill_hidden_states(
            cls._append_prefill_hidden_states
        )
    gbr = utils.GenerationBatchResult
    if not getattr(gbr.copy_to_cpu, "__eagle3_patched__", False):
        gbr.copy_to_cpu = make_copy_to_cpu(gbr.copy_to_cpu, utils._async_d2h)
    if not getattr(abs_mod.configure_aux_hidden_state_capture, "__eagle3_patched__", False):
        wrapped = make_configure_aux(abs_mod.configure_aux_hidden_state_capture)
        abs_mod.configure_aux_hidden_state_capture = wrapped
        mr.configure_aux_hidden_state_capture = wrapped


def main(argv: Optional[list[str]] = None) -> None:
    """Parse ``--capture-dir``, check flags and version, patch, then run SGLang's server entry point."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        cap, max_length, sgl_argv = split_args(argv)
        check_server_flags(sgl_argv, max_length)
        Path(cap).mkdir(parents=True, exist_ok=True)
        os.environ[eagle3_capture.ENV_DIR] = str(Path(cap).resolve())
        apply_patch()
    except LaunchError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    # SGLang's own entry point (sglang/launch_server.py, `if __name__ == "__main__":` block)
    from sglang.launch_server import run_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    load_plugins()
    server_args = prepare_server_args(sgl_argv)
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


# Import-time hook: in a spawned SGLang worker this file is re-imported as __mp_main__ with the
# capture dir in the environment; patch there before the worker's target runs.
if __name__ == "__mp_main__" and os.environ.get(eagle3_capture.ENV_DIR):
    apply_patch()

if __name__ == "__main__":
    main()
