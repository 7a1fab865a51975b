"""EAGLE-3 capture writer running INSIDE the SGLang 0.5.23 server (scheduler processes).

Stock SGLang with ``--enable-return-aux-hidden-states`` returns the captured prefill states of a
``return_hidden_states: true`` request as JSON float lists (``[L, 3H]`` floats per sample: for
Kimi-K2.5 at 4096 tokens that is 88 M numbers of text), and never returns the last hidden state
(``LogitsProcessorOutput.last_hidden_states`` is "for in-process consumers ... not copied into
the response path", ``srt/layers/logits_processor.py``). This module changes only how those states
leave the scheduler:

- ``store_prefill_capture``: instead of appending ``tolist()`` floats to ``req.hidden_states``
  (``SchedulerBatchResultProcessor._append_prefill_hidden_states``), split the packed aux rows
  ``[L, K*H]`` into K tensors ``[L, H]``, add the post-norm last hidden state ``[L, H]``, and write
  ``{capture_dir}/{rid}.pt`` (bf16, ``torch.save``; temp name + ``os.replace``) from one rank. The
  JSON response then carries ``"hidden_states": []``.
- ``copy_last_hidden_states``: queue the device->host copy of ``last_hidden_states`` next to the
  copy of ``hidden_states`` (``GenerationBatchResult.copy_to_cpu``): under overlap scheduling both
  are views of CUDA-graph buffers that the next replay rewrites.
- ``record_capture_layers``: after ``configure_aux_hidden_state_capture`` set the model's
  ``layers_to_capture``, write ``{capture_dir}/capture_info.json`` (the HF indices actually captured,
  shapes, SGLang version) so the client can verify the layers before trusting any tensor.

It is enabled by the environment variable ``EAGLE3_CAPTURE_DIR`` (set by
``sglang_capture_launcher.py --capture-dir``; inherited by SGLang's spawned scheduler processes).
The model code is untouched. The same file is added as ``sglang/srt/managers/eagle3_capture.py``
by ``sglang-0.5.23-capture.diff``. It imports nothing from SGLang at module level (testable
without SGLang's dependencies) and nothing from the eagle3 package (it runs in SGLang's env).
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional

import torch

logger = logging.getLogger("eagle3_capture")

ENV_DIR = "EAGLE3_CAPTURE_DIR"
INFO_FILE = "capture_info.json"
FORMAT_VERSION = 1
SAMPLE_SUFFIX = ".pt"
ERROR_SUFFIX = ".error.json"
#: request ids that are safe as file names (the client sends hex/uuid-like ids)
RID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")

#: HF indices captured by this process's model (set by record_capture_layers), copied into each sample file.
_STATE: dict[str, Any] = {"layers": None}


def capture_dir() -> Optional[Path]:
    """The capture folder from ``$EAGLE3_CAPTURE_DIR``, or None when the capture patch is inactive."""
    d = os.environ.get(ENV_DIR)
    return Path(d) if d else None


def enabled() -> bool:
    """True when ``$EAGLE3_CAPTURE_DIR`` is set (then full-capture prefill states go to files)."""
    return capture_dir() is not None


def is_writer_rank() -> bool:
    """True on the one process per request group that writes files: attention-TP rank 0.

    With plain tensor parallelism every TP rank's scheduler holds the same requests and the same
    (replicated) residual stream; only rank 0 writes. Falls back to ``torch.distributed`` rank 0.
    """
    try:
        from sglang.srt.runtime_context import get_parallel  # SGLang 0.5.23: srt/runtime_context.py

        p = get_parallel()
        rank = getattr(p, "attn_tp_rank", None)
        if rank is None:
            rank = getattr(p, "tp_rank")
        return int(rank) == 0 and int(getattr(p, "attn_cp_rank", 0) or 0) == 0
    except Exception:
        import torch.distributed as dist

        return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """Run ``write(tmp)`` on a temp file next to ``path``, fsync, then ``os.replace`` (atomic on POSIX)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix="." + path.name + ".tmp-", dir=path.parent)
    os.close(fd)
    tmp_p = Path(tmp)
    try:
        write(tmp_p)
        with open(tmp_p, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp_p, path)
    except BaseException:
        tmp_p.unlink(missing_ok=True)
        raise


def write_json(path: Path, obj: Any) -> None:
    """Atomically write ``obj`` as JSON."""
    _atomic_write(path, lambda p: p.write_text(json.dumps(obj, indent=1), encoding="utf-8"))


def sample_path(folder: Path, rid: str) -> Path:
    """``{folder}/{rid}.pt``."""
    return Path(folder) / f"{rid}{SAMPLE_SUFFIX}"


def error_path(folder: Path, rid: str) -> Path:
    """``{folder}/{rid}.error.json``: why a request's states were not written."""
    return Path(folder) / f"{rid}{ERROR_SUFFIX}"


def write_sample(folder: Path, rid: str, input_ids: list[int], aux_packed: torch.Tensor,
                 last: torch.Tensor, layers: Optional[list[int]] = None) -> Path:
    """Write one request's states to ``{folder}/{rid}.pt`` atomically.

    Args:
        input_ids: the prompt token ids the server prefilled (``req.origin_input_ids``), length L.
        aux_packed: ``[L, K*H]`` aux states packed in capture order (``pack_aux_hidden_states``:
            ``torch.cat`` of the K ``[L, H]`` captures along the last dim, increasing layer id).
        last: ``[L, H]`` last-layer hidden states after the final norm (SGLang's ``last_hidden_states``).
        layers: the HF indices captured (SGLang ``layers_to_capture``), recorded for the client.

    File: ``{"format": 1, "rid": str, "input_ids": int64 [L], "hidden_states": [K + 1 x bf16 [L, H]]
    (aux in layer order, then last), "layers": list[int], "last_hidden_state": "post_norm"}``; every
    tensor is a compact copy (a view would drag the whole batch buffer into the file).

    Raises:
        ValueError: shapes disagree (rows != L, or K*H not a multiple of H).
    """
    L = len(input_ids)
    H = int(last.shape[-1])
    if last.dim() != 2 or aux_packed.dim() != 2 or last.shape[0] != L or aux_packed.shape[0] != L:
        raise ValueError(f"rid {rid}: aux {tuple(aux_packed.shape)} / last {tuple(last.shape)} rows != {L} prompt tokens")
    if aux_packed.shape[1] % H:
        raise ValueError(f"rid {rid}: packed aux width {aux_packed.shape[1]} is not a multiple of hidden size {H}")
    K = aux_packed.shape[1] // H

    def compact(t: torch.Tensor) -> torch.Tensor:  # [L, H] bf16, own storage
        return t.to(device="cpu", dtype=torch.bfloat16).clone(memory_format=torch.contiguous_format)

    states = [compact(aux_packed[:, k * H:(k + 1) * H]) for k in range(K)] + [compact(last)]  # K+1 x [L, H]
    obj = {
        "format": FORMAT_VERSION,
        "rid": rid,
        "input_ids": torch.tensor(list(input_ids), dtype=torch.int64),  # [L]
        "hidden_states": states,
        "layers": list(layers) if layers is not None else [],
        "last_hidden_state": "post_norm",
    }
    path = sample_path(folder, rid)
    _atomic_write(path, lambda p: torch.save(obj, p))
    return path


def write_error(folder: Path, rid: str, message: str) -> None:
    """Record why ``rid`` has no sample file (the client raises with this message)."""
    logger.error("eagle3 capture: rid %s: %s", rid, message)
    write_json(error_path(folder, rid), {"rid": rid, "error": message})


def store_prefill_capture(*, req: Any, logits_output: Any, start: int, extend_input_len: int, store: bool) -> int:
    """Replacement for the full-capture branch of ``_append_prefill_hidden_states`` (SGLang 0.5.23).

    Same offset bookkeeping as the original (rows ``[start, start + extend_input_len)`` of the
    batch belong to ``req``), but the rows are written to ``{capture_dir}/{rid}.pt`` instead of
    being appended to ``req.hidden_states`` as float lists, which stays empty.

    A request whose prefill did not cover its whole prompt (radix-cache prefix hit, or a chunked
    prefill whose earlier chunks were never stored) gets ``{rid}.error.json`` instead: its states
    are incomplete and must not be used.

    Returns:
        The next row offset, ``start + extend_input_len``.
    """
    end = start + int(extend_input_len)
    folder = capture_dir()
    if not store or folder is None or not is_writer_rank():
        return end
    rid = str(req.rid)
    if not RID_RE.match(rid):
        logger.error("eagle3 capture: request id %r is not a safe file name; states dropped", rid)
        return end
    n_prompt = len(req.origin_input_ids)
    if int(extend_input_len) != n_prompt:
        write_error(folder, rid, f"prefill covered {int(extend_input_len)} of {n_prompt} prompt tokens "
                    "(prefix-cache hit or chunked prefill): launch with --disable-radix-cache and "
                    "--chunked-prefill-size -1")
        return end
    last = getattr(logits_output, "last_hidden_states", None)
    if last is None:
        write_error(folder, rid, "the server kept no last_hidden_states: launch with "
                    "--enable-return-aux-hidden-states --speculative-algorithm EAGLE3")
        return end
    try:
        write_sample(folder, rid, list(req.origin_input_ids), logits_output.hidden_states[start:end],
                     last[start:end], _STATE["layers"])
    except ValueError as e:
        write_error(folder, rid, str(e))
    return end


def copy_last_hidden_states(result: Any, return_hidden_states: bool, d2h: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Queue ``last_hidden_states``' device->host copy with ``d2h`` (SGLang's ``async_d2h``).

    Must run on the same stream and before ``copy_done.record()`` of ``GenerationBatchResult.copy_to_cpu``.
    """
    lo = getattr(result, "logits_output", None)
    if (return_hidden_states and enabled() and lo is not None and getattr(lo, "hidden_states", None) is not None
            and getattr(lo, "last_hidden_states", None) is not None):
        lo.last_hidden_states = d2h(lo.last_hidden_states)


def layers_to_capture_of(model: Any) -> Optional[list[int]]:
    """The model's ``layers_to_capture`` (HF indices; Llama/DeepSeek keep it on ``model.model``,
    Kimi-K2.5 on ``model.language_model.model``), or None."""
    for path in (("model",), ("language_model", "model"), ("language_model",), ()):
        obj = model
        for attr in path:
            obj = getattr(obj, attr, None)
        val = getattr(obj, "layers_to_capture", None) if obj is not None else None
        if val is not None and not callable(val):
            return [int(i) for i in val]
    return None


def record_capture_layers(model: Any) -> None:
    """After SGLang configured aux capture: remember the layers and write ``capture_info.json``.

    ``capture_info.json``: ``{"format", "sglang_version", "architecture", "layers_to_capture" (HF indices),
    "num_hidden_layers", "hidden_size", "vocab_size", "last_hidden_state": "post_norm"}``.
    """
    layers = layers_to_capture_of(model)
    _STATE["layers"] = layers
    folder = capture_dir()
    if folder is None or not is_writer_rank():
        return
    cfg = getattr(model, "config", None)
    tc = getattr(cfg, "text_config", None) or cfg
    try:
        from importlib.metadata import version

        sgl_version = version("sglang")
    except Exception:
        sgl_version = None
    write_json(folder / INFO_FILE, {
        "format": FORMAT_VERSION,
        "sglang_version": sgl_version,
        "architecture": type(model).__name__,
        "layers_to_capture": layers,
        "num_hidden_layers": getattr(tc, "num_hidden_layers", None),
        "hidden_size": getattr(tc, "hidden_size", None),
        "vocab_size": getattr(tc, "vocab_size", None),
        "last_hidden_state": "post_norm",
    })
