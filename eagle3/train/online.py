"""Where stage 04 gets the verifier's hidden states (``train.hidden_states``).

``offline`` (:class:`ShardStates`): with each loader batch, from stage 02's shards. ``online``: 02 wrote
token-only samples and each micro-batch's states are computed as training consumes them, with 02's capture code:
``extract.backend: hf`` (:class:`VerifierStates`): a frozen verifier replica per rank on its training device,
:meth:`eagle3.capture.hf.HFCapture.prefill_states` without a mask (right padding, causal verifier) and without a
host sync, padded rows zeroed, rounded to bf16 as 02 stores them (same features as 02's shards); ``sglang``
(:class:`ServerStates`): 02's capture client on a thread pool, ``train.online_prefetch`` batches ahead, collated as
:func:`eagle3.data.dataset.collate` does. NaN/Inf: ``VerifierStates`` ANDs a device flag the trainer reads at log
steps; ``ServerStates`` scans each batch on its capture thread. Either checks its verifier against
``data_config.json`` (:func:`check_conventions`).
"""

from __future__ import annotations

import collections
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from eagle3.errors import UserError
from eagle3.process_group import is_rank0
from eagle3.shards.data_config import is_token_only
from eagle3.shards.format import DATA_CONFIG

log = logging.getLogger(__name__)


class ShardStates:
    """Offline: the states are in the shards; every hook is the identity."""

    reads_shard_states = True

    def wrap(self, batches: Iterator[dict]) -> Iterator[dict]:
        return batches

    def fill(self, batch: dict) -> dict:
        return batch

    def states_finite(self) -> bool:
        """True: 02 refused non-finite states before writing them."""
        return True

    def close(self) -> None:
        pass


def _nonfinite_error(verifier_dtype: str, where: str) -> UserError:
    return UserError(
        f"online hidden states: the verifier gave NaN/Inf {where} with verifier.dtype {verifier_dtype}; "
        "set verifier.dtype: bfloat16 (float16 overflows on large activations) or float32"
    )


def check_conventions(info: dict, aux_layers: list[int], data_config: dict, where: str) -> None:
    """UserError (``data_config.json``'s key, both values, the fix) when the backend's ``info`` (hidden size, vocab,
    layers, architecture, last-state convention) or ``aux_layers`` differ from ``data_config``; ``where`` names it.
    """
    keys = ("hidden_size", "vocab_size", "num_layers", "architecture", "last_hidden_state")
    for key, value in [*((k, info[k]) for k in keys), ("aux_layers", list(aux_layers))]:
        if data_config.get(key) != value:
            raise UserError(
                f"{DATA_CONFIG}: key '{key}' is {data_config.get(key)!r} but {where} gives {value!r}; "
                "online training must run the verifier stage 02 prepared the samples for (re-run 02)"
            )


@dataclass(eq=False)
class VerifierStates(ShardStates):
    """Online in-process verifier (``extract.backend: hf``): ``capture`` an :class:`eagle3.capture.hf.HFCapture` on the
    training device; ``feat_dtype`` the drafter's feature dtype.
    """

    reads_shard_states = False
    capture: Any
    feat_dtype: torch.dtype
    verifier_dtype: str = "?"
    _finite: Optional[torch.Tensor] = None  # 0-dim bool on the device: all finite so far

    @classmethod
    def load(
        cls, verifier, data_config: dict, device: torch.device, feat_dtype: torch.dtype
    ) -> "VerifierStates":
        """This rank's frozen verifier replica on ``device`` (``verifier``: the config section), checked; UserError when it
        cannot be loaded or differs from ``data_config.json``.
        """
        from eagle3.capture.hf import HFCapture
        from eagle3.verifier.load import load_verifier

        model, tok = load_verifier(verifier, device=device)
        model.eval()
        model.requires_grad_(False)
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        capture = HFCapture(model, list(data_config["aux_layers"]), pad_id=pad)
        check_conventions(
            capture.info(),
            capture.aux_layers,
            data_config,
            f"the verifier {verifier.display_name()!r}",
        )
        if is_rank0():  # every rank loads its replica: said once
            log.info(
                "online hidden states: %s on %s (%s)",
                verifier.display_name(),
                device,
                verifier.dtype,
            )
        return cls(capture, feat_dtype, verifier.dtype)

    def fill(self, batch: dict) -> dict:
        """A device batch plus ``aux`` ``[B, L, 3H]`` and ``last`` ``[B, L, H]`` (feature dtype, zero on padding) from one
        verifier prefill of ``input_ids`` ``[B, L]``.
        """
        states = self.capture.prefill_states(batch["input_ids"], None)  # 4 x [B, L, H]
        pad = batch["attention_mask"].unsqueeze(-1) == 0  # [B, L, 1]
        # bf16 first: the rounding 02 applies before it stores a state
        aux = torch.cat([s.to(torch.bfloat16) for s in states[:3]], dim=-1)  # [B, L, 3H]
        aux = aux.masked_fill_(pad, 0)
        last = states[3].to(torch.bfloat16).masked_fill_(pad, 0)  # [B, L, H]
        del states
        ok = torch.isfinite(aux).all() & torch.isfinite(last).all()  # 0-dim, on the device
        self._finite = ok if self._finite is None else self._finite & ok
        return {**batch, "aux": aux.to(self.feat_dtype), "last": last.to(self.feat_dtype)}

    def states_finite(self) -> bool:
        """Whether every state since the last call was finite (one host sync); resets the flag."""
        ok = self._finite is None or bool(self._finite)
        self._finite = None
        return ok

    def nonfinite_error(self, step: int) -> UserError:
        """The UserError every rank raises when :meth:`states_finite` was False on some rank."""
        return _nonfinite_error(
            self.verifier_dtype, f"in a micro-batch up to optimizer step {step}"
        )

    def close(self) -> None:
        self.capture = None  # the replica goes with the last reference


def attach_states(
    batch: dict, states: list[list[torch.Tensor]], hidden_size: int, pin: bool = False
) -> dict:
    """A collated token batch plus ``aux`` bf16 ``[B, Lmax, 3H]`` and ``last`` bf16 ``[B, Lmax, H]`` from per-sample
    captured states (4 x bf16 ``[L_b, H]``), zero-padded as :func:`eagle3.data.dataset.collate` pads shard states.

    Raises:
        RuntimeError: a broken capture contract (:func:`eagle3.capture.base.check_captured`); UserError: NaN/Inf.
    """
    from eagle3.capture.base import check_captured
    from eagle3.shards.format import all_finite

    ids, lengths = batch["input_ids"], batch["lengths"]
    B, Lmax = ids.shape
    aux = torch.zeros((B, Lmax, 3 * hidden_size), dtype=torch.bfloat16, pin_memory=pin)
    last = torch.zeros((B, Lmax, hidden_size), dtype=torch.bfloat16, pin_memory=pin)  # [B, Lmax, H]
    for b, st in enumerate(states):
        n = int(lengths[b])
        check_captured(ids[b, :n].tolist(), st, hidden_size, f"online batch row {b}")
        aux[b, :n] = torch.cat(st[:3], dim=-1)
        last[b, :n] = st[3]
    if not (all_finite(aux) and all_finite(last)):
        raise _nonfinite_error("of the capture server(s)", f"in a captured batch of {B} samples")
    return {**batch, "aux": aux, "last": last}


class CapturedBatches:
    """Token batches with their states from a capture backend, ``depth`` batches captured ahead on a thread pool, in
    order; :meth:`close` drops what is queued.
    """

    def __init__(
        self, batches: Iterator[dict], backend, hidden_size: int, depth: int, pin: bool = False
    ):
        self._src = batches
        self._backend = backend
        self._hidden = hidden_size
        self._pin = pin
        self._depth = int(depth)
        self._pool = ThreadPoolExecutor(self._depth, thread_name_prefix="online-capture")
        self._ahead: collections.deque[Future] = collections.deque()
        self._fill()

    def _capture(self, batch: dict) -> dict:
        rows = [batch["input_ids"][b, : int(n)].tolist() for b, n in enumerate(batch["lengths"])]
        return attach_states(batch, self._backend.capture(rows), self._hidden, self._pin)

    def _fill(self) -> None:
        while self._pool is not None and len(self._ahead) < self._depth:
            nxt = next(self._src, None)
            if nxt is None:
                return
            self._ahead.append(self._pool.submit(self._capture, nxt))

    def __iter__(self) -> "CapturedBatches":
        return self

    def __next__(self) -> dict:
        if not self._ahead:
            raise StopIteration
        fut = self._ahead.popleft()
        self._fill()  # batch k+depth starts before batch k is handed over
        return fut.result()

    def close(self) -> None:
        for fut in self._ahead:
            fut.cancel()
        self._ahead.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._src = iter(())


@dataclass(eq=False)
class ServerStates(ShardStates):
    """Online against capture servers (``extract.backend: sglang``): :class:`CapturedBatches` on the host, then moved
    to the device like shard states.
    """

    reads_shard_states = False
    backend: Any
    hidden_size: int
    depth: int
    pin: bool

    @classmethod
    def connect(
        cls, extract, prefetch: int, data_config: dict, device: torch.device, backend=None
    ) -> "ServerStates":
        """Connect to ``extract.sglang_url`` with 02's client settings (``backend``: a prebuilt one, for tests) and check
        the servers; ``prefetch``: ``train.online_prefetch``. UserError: missing URL or folder, unreachable,
        misconfigured, or another verifier than ``data_config.json``'s.
        """
        if backend is None:
            from eagle3.capture.multi import sglang_backend

            ex = extract
            check_hidden_states("online", ex, None, data_config)
            backend = sglang_backend(
                ex.sglang_url,
                ex.capture_dir,
                list(data_config["aux_layers"]),
                timeout=ex.sglang_timeout_s,
                max_length=ex.max_length,
                max_requests=ex.requests_per_batch,
                per_server=ex.batches_in_flight_per_server,
                max_failures=ex.server_max_failures,
            )
        check_conventions(
            backend.info(), list(backend.aux_layers), data_config, "the capture server(s)"
        )
        return cls(backend, int(data_config["hidden_size"]), prefetch, device.type == "cuda")

    def wrap(self, batches: Iterator[dict]) -> CapturedBatches:
        return CapturedBatches(batches, self.backend, self.hidden_size, self.depth, self.pin)


def check_hidden_states(
    hidden_states: str, extract, shards_dir: Optional[Path], data_config: dict
) -> None:
    """Before anything heavy, that ``train.hidden_states`` has its source: offline training needs samples with hidden
    states (not token-only ones, ``data_config`` of ``shards_dir``; None only for ``online``), online training with
    ``extract.backend: sglang`` the servers the config names (``extract.sglang_url`` and ``extract.capture_dir``).

    Raises:
        UserError: naming ``format`` and both fixes, or the two ``extract`` keys.
    """
    if hidden_states == "offline" and is_token_only(data_config):
        problem = (
            f"{shards_dir / DATA_CONFIG}: key 'format' is {data_config['format']!r} (token-only "
            "samples, no hidden states); set train.hidden_states: online, or re-run 02 with offline"
        )
    elif (
        hidden_states == "online"
        and extract.backend == "sglang"
        and not (extract.sglang_url and extract.capture_dir)
    ):
        problem = (
            "extract.sglang_url / extract.capture_dir: required for train.hidden_states: online "
            "with extract.backend: sglang (the capture servers 04 trains from)"
        )
    else:
        return
    raise UserError(problem)


def unused_shard_states_note(
    hidden_states: str, backend: str, shards_dir: Path, data_config: dict
) -> Optional[str]:
    """The info line of online training over shards that hold states (02 ran offline): they are not read; ``offline``
    trains from them. None otherwise.
    """
    if hidden_states != "online" or is_token_only(data_config):
        return None
    return (
        f"train.hidden_states: online: {shards_dir} holds the verifier's hidden states too (format "
        f"{data_config.get('format')!r}, 02 ran offline); they are not read: online computes each micro-batch's "
        f"states with the verifier (extract.backend {backend}), as asked; set train.hidden_states: "
        f"offline to train from the shards without running the verifier"
    )


def state_source(s, d, data_config: dict, feat_dtype: torch.dtype):
    """The hidden-state source of ``s.train.hidden_states`` (``s``: :class:`eagle3.train.inputs.Setup`, ``d``: this
    rank's :class:`eagle3.process_group.Dist`): the shards, the verifier on ``d.device``, or the capture servers of
    ``s.extract`` with ``train.online_prefetch`` batches ahead; rank 0 logs :func:`unused_shard_states_note` first.
    UserError as :func:`check_hidden_states` or when a source cannot start.
    """
    hidden, ex = s.train.hidden_states, s.extract
    unused = unused_shard_states_note(hidden, ex.backend, s.shards_dir, data_config)
    if unused and d.is_main:
        log.info(unused)
    check_hidden_states(hidden, ex, s.shards_dir, data_config)
    if hidden == "offline":
        return ShardStates()
    if ex.backend == "sglang":
        return ServerStates.connect(ex, s.train.online_prefetch, data_config, d.device)
    return VerifierStates.load(s.verifier, data_config, d.device, feat_dtype)
