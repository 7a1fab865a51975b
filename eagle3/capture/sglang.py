"""Capture backend over a patched SGLang 0.5.23 server (production path: Kimi-K2.5 on 8 GPUs).

The server runs ``patches/sglang_capture_launcher.py`` (see ``patches/README.md``): stock SGLang
with ``--enable-return-aux-hidden-states --speculative-algorithm EAGLE3`` captures the residual
stream entering the configured layers (HF indices, ``eagle3.engines.layers``) and keeps the post-norm last
hidden state; the patch writes both, per request, to ``{capture_dir}/{rid}.pt`` instead of putting
float lists in the JSON response, and writes ``{capture_dir}/capture_info.json`` at start-up with
the layers actually captured.

Protocol of one :meth:`SGLangCapture.capture` call (SGLang ``/generate``, ``GenerateReqInput``):
POST ``{"input_ids": [[...], ...], "rid": [...], "return_hidden_states": true,
"sampling_params": {"max_new_tokens": 1, "temperature": 0}}``; the response is a list (batch order)
whose ``meta_info`` carries ``id`` (= rid), ``prompt_tokens`` and ``cached_tokens``. Then each
``{rid}.pt`` (``{"input_ids" [L], "hidden_states": 4 x bf16 [L, H], "layers", ...}``) is read with
``weights_only=True``, checked and deleted. HTTP uses the standard library (urllib).
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import threading
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from eagle3.capture.base import NUM_CAPTURED, BackendInfo
from eagle3.engines.layers import engine_layer_ids
from eagle3.errors import UserError
from eagle3.io import read_json
from eagle3.io.read import safe_torch_load

log = logging.getLogger(__name__)

SUPPORTED_VERSION = "0.5.23"
INFO_FILE = "capture_info.json"  # written by patches/eagle3_capture.py record_capture_layers
SAMPLE_SUFFIX = ".pt"
ERROR_SUFFIX = ".error.json"


class SGLangCapture:
    """:class:`eagle3.capture.base.CaptureBackend` backed by the patched SGLang server.

    Args:
        url: server base URL (``extract.sglang_url``), e.g. ``http://127.0.0.1:30000``.
        capture_dir: the folder given to the launcher's ``--capture-dir`` (``extract.capture_dir``);
            must be on the same host as the server (the server writes, this process reads and deletes).
        aux_layers: the three HF ``hidden_states`` indices the run expects; checked against what the
            server reports capturing (``capture_info.json``), so an off-by-one layer convention
            between extraction and serving fails here instead of producing a useless drafter.
            None = accept the server's layers (set on the first :meth:`info`).
        timeout: seconds allowed for one ``/generate`` batch.
        max_length: the run's ``extract.max_length`` (recorded; the server check does not depend on it: its
            ``chunked_prefill_size`` must be -1 for any prompt length, see :meth:`info`).
        max_requests: prompts per ``/generate`` POST (a larger batch is split; None = one POST).

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
        if not url:
            raise UserError("extract.sglang_url: required for extract.backend: sglang")
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
        self._rid_lock = (
            threading.Lock()
        )  # capture() may run on several threads (eagle3.capture.multi)

    # ---- HTTP ----------------------------------------------------------------------------
    def _request(self, path: str, payload: Optional[dict] = None) -> Any:
        """GET (payload None) or POST JSON to ``{url}{path}``; parsed JSON back.

        Raises:
            UserError: connection refused/timeout, HTTP error status, or a non-JSON body.
        """
        data = json.dumps(payload).encode("utf-8") if payload is not None else None
        req = urllib.request.Request(
            self.url + path,
            data=data,
            method="POST" if data is not None else "GET",
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                body = resp.read()
        except urllib.error.HTTPError as e:
            detail = e.read().decode("utf-8", "replace").strip().splitlines()
            raise UserError(
                f"extract.sglang_url {self.url}{path}: HTTP {e.code}: {detail[0][:300] if detail else e.reason}"
            ) from e
        except (urllib.error.URLError, TimeoutError, OSError) as e:
            raise UserError(
                f"extract.sglang_url {self.url}{path}: server not reachable: {getattr(e, 'reason', e)}"
            ) from e
        except (
            http.client.HTTPException
        ) as e:  # IncompleteRead, BadStatusLine: the server died mid-answer
            raise UserError(
                f"extract.sglang_url {self.url}{path}: connection broken mid-response: "
                f"{type(e).__name__}: {e}"
            ) from e
        try:
            return json.loads(body)
        except json.JSONDecodeError as e:
            raise UserError(
                f"extract.sglang_url {self.url}{path}: response is not JSON: {body[:120]!r}"
            ) from e

    def _get_first(self, *paths: str) -> dict:
        """GET the first endpoint that exists (``/model_info`` replaced ``/get_model_info`` in 0.5.x)."""
        last: Optional[UserError] = None
        for p in paths:
            try:
                out = self._request(p)
                if isinstance(out, dict):
                    return out
            except UserError as e:
                if "HTTP 404" not in str(e):
                    raise
                last = e
        raise last or UserError(f"extract.sglang_url {self.url}: none of {list(paths)} answered")

    # ---- contract ------------------------------------------------------------------------
    def info(self) -> BackendInfo:
        """Verifier dims and conventions, from the server and the patch's ``capture_info.json``.

        Checks (each a UserError naming the endpoint, file or flag): SGLang version 0.5.23; radix
        cache disabled; aux capture on; chunked prefill off (``chunked_prefill_size`` -1: SGLang 0.5.23 shares one
        chunk budget among the prompts of a prefill batch and splits the prompt that overflows it, however short,
        ``schedule_policy.py`` ``_select_prefill_admission``; a split prompt's earlier chunks are never captured);
        the layers the server captures equal ``aux_layers`` (the message gives the flag value that would fix it).
        """
        if self._info is not None:
            return self._info
        model = self._get_first("/model_info", "/get_model_info")
        server = self._get_first("/server_info", "/get_server_info")
        where = f"extract.sglang_url {self.url}/server_info"
        _check_server(server, where)
        info_path = self.capture_dir / INFO_FILE
        if not info_path.is_file():
            raise UserError(
                f"{info_path}: not found; is the server running patches/sglang_capture_launcher.py "
                "with this --capture-dir, on this host?"
            )
        cap = read_json(info_path)
        for key in ("layers_to_capture", "num_hidden_layers", "hidden_size", "vocab_size"):
            if cap.get(key) is None:
                raise UserError(f"{info_path}: key '{key}' missing")
        archs = model.get("architectures") or [cap.get("architecture") or "unknown"]
        arch = str(archs[0])
        layers = [int(i) for i in cap["layers_to_capture"]]
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
        self._info = {
            "num_layers": int(cap["num_hidden_layers"]),
            "hidden_size": int(cap["hidden_size"]),
            "vocab_size": int(cap["vocab_size"]),
            "architecture": arch,
            "last_hidden_state": _last_hidden_state(cap, info_path),
        }
        return self._info

    def capture(self, batch: list[list[int]]) -> list[list[torch.Tensor]]:
        """Prefill ``batch`` on the server; per sample ``[aux1, aux2, aux3, last]``, each bf16 CPU ``[L_i, H]``.

        Raises:
            UserError: the server prefilled other tokens than sent (count or ids), served a cached
                prefix, reported an error for a request, did not write a capture file, or wrote one
                with the wrong shapes/layers. The capture files of the batch are deleted either way.
        """
        if not batch:
            return []
        step = self.max_requests or len(batch)
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
        try:
            resp = self._request("/generate", payload)
            if isinstance(resp, dict):
                resp = [resp]
            if not isinstance(resp, list) or len(resp) != len(batch):
                raise UserError(
                    f"extract.sglang_url {self.url}/generate: expected {len(batch)} results, "
                    f"got {len(resp) if isinstance(resp, list) else type(resp).__name__}"
                )
            by_rid = {}
            for r in resp:
                meta = r.get("meta_info", {}) if isinstance(r, dict) else {}
                by_rid[str(meta.get("id"))] = meta
            return [self._read_one(rid, ids, by_rid.get(rid), H) for rid, ids in zip(rids, batch)]
        finally:
            for rid in rids:
                for suffix in (SAMPLE_SUFFIX, ERROR_SUFFIX):
                    (self.capture_dir / f"{rid}{suffix}").unlink(missing_ok=True)

    def _read_one(
        self, rid: str, ids: list[int], meta: Optional[dict], H: int
    ) -> list[torch.Tensor]:
        where = f"extract.sglang_url {self.url}/generate rid {rid}"
        L = len(ids)
        _check_meta(meta, L, where)
        err = self.capture_dir / f"{rid}{ERROR_SUFFIX}"
        if err.is_file():
            raise UserError(f"{err}: {read_json(err).get('error', 'capture failed')}")
        path = self.capture_dir / f"{rid}{SAMPLE_SUFFIX}"
        if not path.is_file():
            raise UserError(
                f"{path}: not written by the server (wrong --capture-dir, another host, or the patch "
                "is not active)"
            )
        obj = safe_torch_load(path)
        if not isinstance(obj, dict) or "hidden_states" not in obj or "input_ids" not in obj:
            raise UserError(
                f"{path}: not a capture file (keys 'input_ids', 'hidden_states' expected)"
            )
        got_ids = obj["input_ids"]  # [L] int64
        if got_ids.tolist() != list(ids):
            raise UserError(
                f"{path}: the server prefilled different token ids than were sent "
                f"({got_ids.numel()} ids, first mismatch at position "
                f"{next((i for i, (a, b) in enumerate(zip(got_ids.tolist(), ids)) if a != b), min(L, got_ids.numel()))})"
            )
        layers = obj.get("layers") or []
        if layers and [int(i) for i in layers] != self.aux_layers:
            raise UserError(
                f"{path}: captured layers {layers}, extract.aux_layers is {self.aux_layers}"
            )
        conv = obj.get("last_hidden_state")
        if conv is not None and self._info is not None and conv != self._info["last_hidden_state"]:
            raise UserError(
                f"{path}: last_hidden_state {conv!r}, but {self.capture_dir / INFO_FILE} says "
                f"{self._info['last_hidden_state']!r} (recorded in data_config.json); the server's patch "
                f"changed under the run: restart it with the same patches/ version and re-run 02"
            )
        states = obj["hidden_states"]
        if len(states) != NUM_CAPTURED:
            raise UserError(
                f"{path}: {len(states)} hidden-state tensors, expected {NUM_CAPTURED} (3 aux + last)"
            )
        for k, t in enumerate(states):
            if tuple(t.shape) != (L, H) or t.dtype != torch.bfloat16:
                raise UserError(
                    f"{path}: hidden_states[{k}] is {tuple(t.shape)} {t.dtype}, "
                    f"expected ({L}, {H}) torch.bfloat16"
                )
        return [t.to("cpu") for t in states]  # 4 x [L, H] bf16


def _check_meta(meta: Optional[dict], L: int, where: str) -> None:
    """Refuse a ``/generate`` result (``meta_info``: ``meta``) for a prompt of ``L`` tokens that the capture cannot
    use: missing, another prompt length, prefix-cached tokens, or hidden-state floats in the response (no
    capture patch). ``where`` names the endpoint and request id.

    Raises:
        UserError: naming the cause and the fix.
    """
    if meta is None:
        raise UserError(f"{where}: no result for this request id in the response")
    if meta.get("prompt_tokens") != L:
        raise UserError(
            f"{where}: server counted {meta.get('prompt_tokens')} prompt tokens, {L} were sent"
        )
    if meta.get("cached_tokens", 0):
        raise UserError(
            f"{where}: {meta['cached_tokens']} prompt tokens came from the prefix cache; "
            "relaunch the server with --disable-radix-cache"
        )
    if meta.get("hidden_states"):
        raise UserError(
            f"{where}: the response carries hidden-state floats: the server is not running the "
            "capture patch (patches/sglang_capture_launcher.py --capture-dir ...)"
        )


def _check_server(server: dict, where: str) -> None:
    """Refuse a server (``/server_info``: ``server``) the capture cannot use: another SGLang than
    :data:`SUPPORTED_VERSION`, the radix cache on, aux capture off, chunked prefill on (a split prompt's earlier
    chunks are never captured). ``where`` names the endpoint in the refusal.

    Raises:
        UserError: naming the flag to relaunch with.
    """
    version = server.get("version")
    if version is not None and version != SUPPORTED_VERSION:
        raise UserError(f"{where}: SGLang {version}; the capture patch is for {SUPPORTED_VERSION}")
    if server.get("disable_radix_cache") is False:
        raise UserError(
            f"{where}: radix cache is on; relaunch with --disable-radix-cache "
            "(cached prefixes are not recomputed, so their states are never captured)"
        )
    if server.get("enable_return_aux_hidden_states") is False:
        raise UserError(
            f"{where}: relaunch with --enable-return-aux-hidden-states --speculative-algorithm EAGLE3"
        )
    chunk = server.get("chunked_prefill_size")
    if isinstance(chunk, int) and not isinstance(chunk, bool) and chunk > 0:
        raise UserError(
            f"{where}: chunked_prefill_size {chunk}: relaunch with --chunked-prefill-size -1 (SGLang "
            f"shares one {chunk}-token chunk budget among the prompts of a prefill batch and splits the "
            "prompt that overflows it, however short; its earlier chunks would never be captured)"
        )


def _last_hidden_state(cap: dict, info_path: Path) -> str:
    """The last-hidden-state convention ``capture_info.json`` records (``post_norm`` | ``pre_norm``). A file without the
    key (a capture patch of before it) is taken as ``post_norm`` (the patch stores SGLang's ``last_hidden_states``,
    after the final norm), as before, but now with one warning line: that default was silent, and 04 applies the
    final norm (or not) by it.

    Raises:
        UserError: a value other than ``post_norm`` / ``pre_norm``.
    """
    conv = cap.get("last_hidden_state")
    if conv is None:
        log.warning(
            "%s: no last_hidden_state recorded (a capture patch of before the key?): taking post_norm, the "
            "state SGLang's last_hidden_states holds after the final norm, unchecked; run the server with this "
            "checkout's patches/sglang_capture_launcher.py, which records it",
            info_path,
        )
        return "post_norm"
    if conv not in ("post_norm", "pre_norm"):
        raise UserError(
            f"{info_path}: key 'last_hidden_state' is {conv!r}, expected post_norm or pre_norm"
        )
    return conv
