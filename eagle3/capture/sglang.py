"""Capture backend over a patched SGLang 0.5.23 server (production path: Kimi-K2.5 on 8 GPUs).

The server runs ``patches/sglang_capture_launcher.py`` (``patches/README.md``): it captures the
residual stream entering the configured layers (HF indices, ``eagle3.engines.layers``) and the
post-norm last hidden state, writes both per request to ``{capture_dir}/{rid}.pt`` and, at start-up,
``{capture_dir}/capture_info.json`` with the layers captured.

One :meth:`SGLangCapture.capture` call POSTs ``/generate`` (``input_ids``, ``rid``,
``return_hidden_states``, one greedy token) and reads, checks and deletes each ``{rid}.pt``
(``{"input_ids" [L], "hidden_states": 4 x bf16 [L, H], "layers", "last_hidden_state"}``).
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from pathlib import Path
from typing import Literal, Optional, Sequence

import torch
from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationInfo, field_validator

from eagle3.capture.base import NUM_CAPTURED, BackendInfo
from eagle3.engines.layers import engine_layer_ids
from eagle3.errors import UserError, validated
from eagle3.io import read_json
from eagle3.io.http import request_json
from eagle3.io.read import safe_torch_load

log = logging.getLogger(__name__)

SUPPORTED_VERSION = "0.5.23"
INFO_FILE = "capture_info.json"  # written by patches/eagle3_capture.py record_capture_layers
SAMPLE_SUFFIX = ".pt"
ERROR_SUFFIX = ".error.json"


class _Loose(BaseModel):
    model_config = ConfigDict(extra="ignore")


#: The launcher flags a capture server must run with, by the ``/server_info`` field that reports them.
_FLAGS = {
    "disable_radix_cache": "radix cache is on; relaunch with --disable-radix-cache (cached prefixes are "
    "not recomputed, so their states are never captured)",
    "enable_return_aux_hidden_states": "relaunch with --enable-return-aux-hidden-states "
    "--speculative-algorithm EAGLE3",
}


class ServerInfo(_Loose):
    """``/server_info`` fields the capture depends on (None: not reported, not checked); a server the
    capture cannot use fails validation with the launcher flag to relaunch with."""

    version: Optional[str] = None
    disable_radix_cache: Optional[bool] = None
    enable_return_aux_hidden_states: Optional[bool] = None
    chunked_prefill_size: Optional[int] = None

    @field_validator("version")
    @classmethod
    def _supported(cls, v):
        if v is not None and v != SUPPORTED_VERSION:
            raise ValueError(f"is SGLang {v}; the capture patch is for {SUPPORTED_VERSION}")
        return v

    @field_validator(*_FLAGS)
    @classmethod
    def _flag_on(cls, v, info: ValidationInfo):
        if v is False:
            raise ValueError(f"is false: {_FLAGS[info.field_name]}")
        return v

    @field_validator("chunked_prefill_size")
    @classmethod
    def _no_chunking(cls, v):
        # SGLang 0.5.23 shares one chunk budget among a prefill batch's prompts and splits the one
        # that overflows it (schedule_policy.py _select_prefill_admission); earlier chunks are lost.
        if v is not None and v > 0:
            raise ValueError(
                f"is {v}: relaunch with --chunked-prefill-size -1 (SGLang shares one {v}-token chunk "
                "budget among the prompts of a prefill batch and splits the prompt that overflows it, "
                "however short; its earlier chunks would never be captured)"
            )
        return v


class ModelInfo(_Loose):
    """``/model_info`` fields the capture reads."""

    architectures: Optional[list[str]] = None


class CaptureInfo(_Loose):
    """``capture_info.json`` as the patch writes it."""

    layers_to_capture: list[int]
    num_hidden_layers: int
    hidden_size: int
    vocab_size: int
    architecture: Optional[str] = None
    last_hidden_state: Optional[Literal["post_norm", "pre_norm"]] = None


class CaptureFile(_Loose):
    """A ``{rid}.pt`` capture file as the patch writes it, validated against the request with context
    ``{"input_ids": [L] sent, "layers": aux layers, "last_hidden_state": capture_info's, "hidden_size": H}``."""

    model_config = ConfigDict(extra="ignore", arbitrary_types_allowed=True)
    input_ids: torch.Tensor  # [L] int64
    layers: Optional[list[int]] = None
    last_hidden_state: Optional[str] = None
    hidden_states: list[torch.Tensor]  # 4 x bf16 [L, H]

    @field_validator("input_ids")
    @classmethod
    def _as_sent(cls, v, info: ValidationInfo):
        got, sent = v.tolist(), info.context["input_ids"]
        if got != sent:
            first = next(
                (i for i, (a, b) in enumerate(zip(got, sent)) if a != b), min(len(got), len(sent))
            )
            raise ValueError(
                f"holds {len(got)} ids: the server prefilled different token ids than were sent "
                f"(first mismatch at position {first})"
            )
        return v

    @field_validator("layers")
    @classmethod
    def _as_configured(cls, v, info: ValidationInfo):
        if v and v != info.context["layers"]:
            raise ValueError(f"is {v}, but extract.aux_layers is {info.context['layers']}")
        return v

    @field_validator("last_hidden_state")
    @classmethod
    def _as_recorded(cls, v, info: ValidationInfo):
        want = info.context["last_hidden_state"]
        if v is not None and v != want:
            raise ValueError(
                f"is {v!r}, but {INFO_FILE} says {want!r} (recorded in data_config.json); the server's "
                "patch changed under the run: restart it with the same patches/ version and re-run 02"
            )
        return v

    @field_validator("hidden_states")
    @classmethod
    def _shapes(cls, v, info: ValidationInfo):
        L, H = len(info.context["input_ids"]), info.context["hidden_size"]
        shapes = [(tuple(t.shape), t.dtype) for t in v]
        if shapes != [((L, H), torch.bfloat16)] * NUM_CAPTURED:
            raise ValueError(
                f"are {shapes}, expected {NUM_CAPTURED} (3 aux + last) x ({L}, {H}) torch.bfloat16"
            )
        return v


class GenerateMeta(_Loose):
    """``meta_info`` of one ``/generate`` result."""

    id: Optional[str] = None
    prompt_tokens: Optional[int] = None
    cached_tokens: Optional[int] = 0
    hidden_states: Optional[list] = None  # floats only when the capture patch is not active

    @field_validator("cached_tokens")
    @classmethod
    def _uncached(cls, v):
        if v:
            raise ValueError(
                f"is {v}: prompt tokens came from the prefix cache; relaunch the server with "
                "--disable-radix-cache"
            )
        return v

    @field_validator("hidden_states")
    @classmethod
    def _patched(cls, v):
        if v:
            raise ValueError(
                "carries hidden-state floats: the server is not running the capture patch "
                "(patches/sglang_capture_launcher.py --capture-dir ...)"
            )
        return v


class GenerateResult(_Loose):
    meta_info: GenerateMeta = GenerateMeta()


_RESULTS = TypeAdapter(list[GenerateResult])


class SGLangCapture:
    """:class:`eagle3.capture.base.CaptureBackend` backed by the patched SGLang server.

    Args:
        url: server base URL (``extract.sglang_url``; its callers refuse a config without one).
        capture_dir: the launcher's ``--capture-dir`` (``extract.capture_dir``), on this host.
        aux_layers: the three HF ``hidden_states`` indices the run expects, checked against
            ``capture_info.json``; None = take the server's (set by the first :meth:`info`).
        timeout: seconds allowed for one HTTP request.
        max_length: the run's ``extract.max_length`` (recorded only).
        max_requests: prompts per ``/generate`` POST (None = the whole batch in one).

    Raises:
        UserError: ``capture_dir`` is not a folder.
    """

    def __init__(
        self,
        url: str,
        capture_dir: str | os.PathLike,
        aux_layers: Optional[Sequence[int]],
        timeout: float = 600.0,
        max_length: Optional[int] = None,
        max_requests: Optional[int] = None,
    ):
        self.url = url.rstrip("/")
        self.capture_dir = Path(capture_dir)
        if not self.capture_dir.is_dir():
            raise UserError(
                f"extract.capture_dir: {self.capture_dir} is not a folder (the server's --capture-dir)"
            )
        self.aux_layers = [int(i) for i in aux_layers] if aux_layers is not None else None
        self.timeout = float(timeout)
        self.max_length = max_length
        self.max_requests = max_requests
        self._info: Optional[BackendInfo] = None
        self._prefix = uuid.uuid4().hex[:12]
        self._count = 0
        self._rid_lock = threading.Lock()  # capture() runs on several threads (capture.multi)

    def _request(self, path: str, payload: Optional[dict] = None):
        return request_json(
            self.url + path, payload, self.timeout, where=f"extract.sglang_url {self.url}{path}"
        )

    def info(self) -> BackendInfo:
        """Verifier dims and conventions, from the server and ``capture_info.json``.

        Raises:
            UserError: another SGLang version, radix cache on, aux capture off, chunked prefill on,
                ``capture_info.json`` missing or malformed, or captured layers other than
                ``aux_layers`` (the message gives the launcher flag that fixes it).
        """
        if self._info is not None:
            return self._info
        model = validated(
            ModelInfo, self._request("/model_info"), f"extract.sglang_url {self.url}/model_info"
        )
        where = f"extract.sglang_url {self.url}/server_info"
        validated(ServerInfo, self._request("/server_info"), where)
        info_path = self._written(
            INFO_FILE,
            "not found; is the server running patches/sglang_capture_launcher.py with this "
            "--capture-dir, on this host?",
        )
        cap = validated(CaptureInfo, read_json(info_path), str(info_path))
        arch = (model.architectures or [cap.architecture or "unknown"])[0]
        layers = cap.layers_to_capture
        if self.aux_layers is None:
            self.aux_layers = layers
        if layers != self.aux_layers:
            try:
                fix = " ".join(str(i) for i in engine_layer_ids(self.aux_layers, "sglang", arch))
                hint = f"relaunch with --return-aux-hidden-state-layer-ids {fix}"
            except UserError as e:
                hint = str(e)
            raise UserError(
                f"{info_path}: the server captures HF layers {layers} but extract.aux_layers is "
                f"{self.aux_layers} ({arch}); {hint}"
            )
        if cap.last_hidden_state is None:
            log.warning(
                "%s: no last_hidden_state recorded (a capture patch of before the key?): taking "
                "post_norm, the state SGLang's last_hidden_states holds after the final norm, "
                "unchecked; run the server with this checkout's patches/sglang_capture_launcher.py, "
                "which records it",
                info_path,
            )
        self._info = {
            "num_layers": cap.num_hidden_layers,
            "hidden_size": cap.hidden_size,
            "vocab_size": cap.vocab_size,
            "architecture": arch,
            "last_hidden_state": cap.last_hidden_state or "post_norm",
        }
        return self._info

    def capture(self, batch: list[list[int]]) -> list[list[torch.Tensor]]:
        """Prefill ``batch``; per sample ``[aux1, aux2, aux3, last]``, each bf16 CPU ``[L_i, H]``.

        Raises:
            UserError: the server prefilled other tokens than sent, served a cached prefix,
                reported an error, or wrote no or a malformed capture file. The batch's capture
                files are deleted either way.
        """
        step = self.max_requests or len(batch) or 1
        out: list[list[torch.Tensor]] = []
        for s in range(0, len(batch), step):
            out.extend(self._capture_chunk(batch[s : s + step]))
        return out

    def _new_rids(self, n: int) -> list[str]:
        with self._rid_lock:
            rids = [f"eagle3-{self._prefix}-{self._count + i}" for i in range(n)]
            self._count += n
        return rids

    def _capture_chunk(self, batch: list[list[int]]) -> list[list[torch.Tensor]]:
        H = self.info()["hidden_size"]
        rids = self._new_rids(len(batch))
        payload = {
            "input_ids": [list(map(int, ids)) for ids in batch],
            "rid": rids,
            "return_hidden_states": True,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
        }
        where = f"extract.sglang_url {self.url}/generate"
        try:
            resp = self._request("/generate", payload)
            results = validated(_RESULTS, [resp] if isinstance(resp, dict) else resp, where)
            unlike = _unlike_sent(results, rids, batch, where)
            if unlike is not None:
                raise UserError(unlike)
            return [self._read_one(rid, ids, H) for rid, ids in zip(rids, batch)]
        finally:
            for rid in rids:
                for suffix in (SAMPLE_SUFFIX, ERROR_SUFFIX):
                    (self.capture_dir / f"{rid}{suffix}").unlink(missing_ok=True)

    def _written(self, name: str, absent: str) -> Path:
        """``capture_dir / name``, a file the patched server writes there (``capture_info.json`` at start-up,
        ``{rid}.pt`` per request).

        Raises:
            UserError: ``<path>: <absent>`` when the file is not there (the server runs without the patch, with
                another ``--capture-dir`` or on another host).
        """
        path = self.capture_dir / name
        if not path.is_file():
            raise UserError(f"{path}: {absent}")
        return path

    def _read_one(self, rid: str, ids: list[int], H: int) -> list[torch.Tensor]:
        """The four captured states of request ``rid`` (``ids`` sent) from its ``{rid}.pt``, checked against the
        request (:class:`CaptureFile`); the error the server wrote for it instead is raised as such."""
        err = self.capture_dir / f"{rid}{ERROR_SUFFIX}"
        if err.is_file():
            raise UserError(f"{err}: {read_json(err).get('error', 'capture failed')}")
        path = self._written(
            f"{rid}{SAMPLE_SUFFIX}",
            "not written by the server (wrong --capture-dir, another host, or the patch is not active)",
        )
        context = {
            "input_ids": list(ids),
            "layers": self.aux_layers,
            "last_hidden_state": self._info["last_hidden_state"],
            "hidden_size": H,
        }
        f = validated(CaptureFile, safe_torch_load(path), str(path), context=context)
        return [t.to("cpu") for t in f.hidden_states]  # 4 x [L, H] bf16


def _unlike_sent(
    results: list[GenerateResult], rids: list[str], batch: list[list[int]], where: str
) -> Optional[str]:
    """Where the ``/generate`` answer ``results`` differs from the request (``rids``, one per prompt of
    ``batch``): not one result per request id sent, or a result whose server counted other than its prompt's
    tokens (the first such, ``<where> rid <rid>: ...``). None when it answers exactly what was sent."""
    by_rid = {str(r.meta_info.id): r.meta_info for r in results}
    if len(results) != len(batch) or set(by_rid) != set(rids):
        return (
            f"{where}: expected one result per request id sent ({len(batch)}), got "
            f"{len(results)} results with {len(set(by_rid) & set(rids))} of the ids"
        )
    for rid, ids in zip(rids, batch):
        if by_rid[rid].prompt_tokens != len(ids):
            return (
                f"{where} rid {rid}: server counted {by_rid[rid].prompt_tokens} prompt tokens, "
                f"{len(ids)} were sent"
            )
    return None
