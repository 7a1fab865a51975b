"""Where stage 04 gets the verifier's hidden states: the shards (offline) or the verifier itself (online).

``train.hidden_states: offline`` (:class:`ShardStates`): the states come with each loader batch from
stage 02's shards, as before. ``online``: stage 02 wrote token-only samples (``eagle3-tokens-v1``,
:mod:`eagle3.shards.format`) and the states of every micro-batch are computed as training consumes them,
with stage 02's own capture code, chosen by ``extract.backend``:

- ``hf`` (:class:`VerifierStates`): each rank loads its own frozen verifier replica on its training
  device (``verifier.dtype``, eval mode, ``requires_grad`` off) and runs
  :meth:`eagle3.capture.hf.HFCapture.prefill_states` (the aux layers' pre-hooks + the decoder's output,
  checked once against ``output_hidden_states``) on the device batch under ``torch.no_grad``, without
  cuDNN SDPA and without a host sync. The batch is right-padded and the verifier causal, so no attention
  mask is passed (real positions never attend to the padding; transformers then takes the causal SDPA
  kernel and skips its all-ones check of the mask, a device sync); padded rows are zeroed afterwards.
  The states are rounded to bf16, as 02 stores them, then cast to the training feature dtype, so
  a micro-batch whose verifier forward equals 02's gives bit-identical features (tests/train/test_online_train.py).
- ``sglang`` (:class:`ServerStates`): the capture client of stage 02 (:func:`eagle3.capture.multi.sglang_backend`:
  one or several patched servers, failover, prompt-id checks) captures each token batch on a thread
  pool, at most ``train.online_prefetch`` micro-batches ahead of the one training (so capture of batch
  k+1 overlaps training on k), and the states are collated exactly as :func:`eagle3.data.dataset.collate`
  collates shard states (bf16, zero padding), in order.

NaN/Inf (a verifier overflowing in its dtype): 02 refuses such states before a shard is written; online,
every micro-batch's states are checked too: ``VerifierStates`` ANDs a device flag per micro-batch (no host
sync) that the trainer reads at its log steps (:meth:`VerifierStates.states_finite`, all ranks agree, then a UserError
naming the verifier dtype and the fix); ``ServerStates`` scans each batch on the capture thread and fails it there.

Either source checks the verifier it runs against ``data_config.json`` (hidden size, vocabulary,
layers, architecture, aux layers, last-hidden-state convention): the drafter's targets depend on them.
"""

from __future__ import annotations

import collections
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Iterator, Optional

import torch

from eagle3.errors import UserError
from eagle3.process_group import is_rank0
from eagle3.shards.data_config import is_token_only
from eagle3.shards.format import DATA_CONFIG

log = logging.getLogger(__name__)


class ShardStates:
    """Offline: the hidden states are in the shards; every hook is the identity."""

    reads_shard_states = True

    def wrap(self, batches: Iterator[dict]) -> Iterator[dict]:
        """The loader's batch iterator, as it is."""
        return batches

    def fill(self, batch: dict) -> dict:
        """A device batch, as it is (``aux``/``last`` already there)."""
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
    """Refuse a verifier whose states would not be the ones ``data_config.json`` describes.

    Args:
        info: the capture backend's :class:`eagle3.capture.base.BackendInfo`.
        aux_layers: the HF ``hidden_states`` indices the backend captures.
        data_config: stage 02's metadata of the samples.
        where: names the verifier in the message.

    Raises:
        UserError: one line naming ``data_config.json``'s key, both values and the fix.
    """
    got = {
        "hidden_size": info["hidden_size"],
        "vocab_size": info["vocab_size"],
        "num_layers": info["num_layers"],
        "architecture": info["architecture"],
        "last_hidden_state": info["last_hidden_state"],
        "aux_layers": list(aux_layers),
    }
    for key, value in got.items():
        if data_config.get(key) != value:
            raise UserError(
                f"{DATA_CONFIG}: key '{key}' is {data_config.get(key)!r} but {where} gives {value!r}; "
                "online training must run the verifier stage 02 prepared the samples for (re-run 02)"
            )


class VerifierStates:
    """Online, in-process verifier (``extract.backend: hf``): states computed on the training device.

    Args:
        capture: an :class:`eagle3.capture.hf.HFCapture` over the frozen verifier on the training device.
        feat_dtype: the drafter's feature dtype (bf16 under autocast, else float32).
    """

    reads_shard_states = False

    def __init__(self, capture, feat_dtype: torch.dtype, verifier_dtype: str = "?"):
        self.capture = capture
        self.feat_dtype = feat_dtype
        self.verifier_dtype = verifier_dtype
        self._finite: Optional[torch.Tensor] = (
            None  # 0-dim bool on the device: every state so far finite
        )

    @classmethod
    def load(
        cls, verifier, data_config: dict, device: torch.device, feat_dtype: torch.dtype
    ) -> "VerifierStates":
        """Load this rank's verifier replica on ``device`` (``verifier``: the config's ``verifier`` section, loaded
        in its ``dtype``), frozen, and check it.

        Raises:
            UserError: the verifier cannot be loaded, or differs from ``data_config.json`` (:func:`check_conventions`).
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
        if is_rank0():  # every torchrun rank loads its replica: said once (each rank's device is its LOCAL_RANK's)
            log.info(
                "online hidden states: %s on %s (%s)",
                verifier.display_name(),
                device,
                verifier.dtype,
            )
        return cls(capture, feat_dtype, verifier.dtype)

    def wrap(self, batches: Iterator[dict]) -> Iterator[dict]:
        """Token batches stay token batches on the host; the states are made on the device (:meth:`fill`)."""
        return batches

    def fill(self, batch: dict) -> dict:
        """Add ``aux`` ``[B, L, 3H]`` and ``last`` ``[B, L, H]`` (feature dtype, zero at padded positions) to a
        device batch (``input_ids`` ``[B, L]``, ``attention_mask`` ``[B, L]``), from one verifier prefill."""
        states = self.capture.prefill_states(
            batch["input_ids"], None
        )  # 4 x [B, L, H], verifier dtype
        pad = batch["attention_mask"].unsqueeze(-1) == 0  # [B, L, 1]
        # bf16 first: the rounding 02 applies before it stores a state (eagle3.capture.hf)
        aux = torch.cat([s.to(torch.bfloat16) for s in states[:3]], dim=-1).masked_fill_(
            pad, 0
        )  # [B, L, 3H]
        last = states[3].to(torch.bfloat16).masked_fill_(pad, 0)  # [B, L, H]
        del states
        ok = (
            torch.isfinite(aux).all() & torch.isfinite(last).all()
        )  # 0-dim, on the device: no sync here
        self._finite = ok if self._finite is None else self._finite & ok
        return {**batch, "aux": aux.to(self.feat_dtype), "last": last.to(self.feat_dtype)}

    def states_finite(self) -> bool:
        """Whether every state since the last call was finite: reads the device flag (one host sync; the
        trainer calls it at its log steps and after the final validation) and resets it."""
        ok = self._finite is None or bool(self._finite)
        self._finite = None
        return ok

    def nonfinite_error(self, step: int) -> UserError:
        """The error the trainer raises (on every rank) when :meth:`states_finite` was False on some rank."""
        return _nonfinite_error(
            self.verifier_dtype, f"in a micro-batch up to optimizer step {step}"
        )

    def close(self) -> None:
        self.capture = None  # the replica goes with the last reference


def attach_states(
    batch: dict, states: list[list[torch.Tensor]], hidden_size: int, pin: bool = False
) -> dict:
    """A collated token batch plus ``aux`` bf16 ``[B, Lmax, 3H]`` and ``last`` bf16 ``[B, Lmax, H]`` built from
    per-sample captured states (``[aux1, aux2, aux3, last]``, each bf16 ``[L_b, H]``), zero-padded: exactly
    what :class:`eagle3.data.dataset.ShardDataset` + :func:`eagle3.data.dataset.collate` give for shards of the same states.

    Raises:
        RuntimeError: the backend broke the capture contract (:func:`eagle3.capture.base.check_captured`).
        UserError: a captured state is NaN/Inf.
    """
    from eagle3.capture.base import check_captured
    from eagle3.shards.format import all_finite

    ids, lengths = batch["input_ids"], batch["lengths"]
    B, Lmax = ids.shape
    aux = torch.zeros(
        (B, Lmax, 3 * hidden_size), dtype=torch.bfloat16, pin_memory=pin
    )  # [B, Lmax, 3H]
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
    """Iterator over token batches with their states from a capture backend, ``depth`` batches ahead.

    The next ``depth`` batches of ``batches`` are submitted to a thread pool as soon as one is taken, so
    their capture (HTTP round trips, capture-file reads) runs while the caller trains; results come back
    in order. :meth:`close` drops what is queued (batches in flight finish and are discarded).
    """

    def __init__(
        self, batches: Iterator[dict], backend, hidden_size: int, depth: int, pin: bool = False
    ):
        self._src = batches
        self._backend = backend
        self._hidden = hidden_size
        self._pin = pin
        self._depth = int(depth)
        self._pool = ThreadPoolExecutor(
            max_workers=self._depth, thread_name_prefix="online-capture"
        )
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


class ServerStates(ShardStates):
    """Online against capture servers (``extract.backend: sglang``): states captured on the host ahead of
    training (:class:`CapturedBatches`), then moved to the device like shard states (``fill``, ``close``
    and ``states_finite`` are :class:`ShardStates`' own: every captured batch was scanned for NaN/Inf on its
    capture thread, :func:`attach_states`)."""

    reads_shard_states = False

    def __init__(self, backend, hidden_size: int, depth: int, pin: bool):
        self.backend = backend
        self.hidden_size = hidden_size
        self.depth = depth
        self.pin = pin

    @classmethod
    def connect(
        cls, extract, prefetch: int, data_config: dict, device: torch.device, backend=None
    ) -> "ServerStates":
        """Connect to ``extract.sglang_url`` (stage 02's client and settings) and check the servers.

        Args:
            extract: the config's ``extract`` section (stage 02's client settings).
            prefetch: batches captured ahead (``train.online_prefetch``).
            backend: an already-built capture backend (tests); default :func:`eagle3.capture.multi.sglang_backend`.

        Raises:
            UserError: missing URL / capture folder, unreachable or misconfigured servers, or servers whose
                verifier differs from ``data_config.json``.
        """
        if backend is None:
            from eagle3.capture.multi import sglang_backend

            ex = extract
            _require_servers("online", ex)
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
        return cls(
            backend,
            int(data_config["hidden_size"]),
            prefetch,
            device.type == "cuda",
        )

    def wrap(self, batches: Iterator[dict]) -> CapturedBatches:
        return CapturedBatches(batches, self.backend, self.hidden_size, self.depth, self.pin)


def _require_servers(hidden_states: str, ex) -> None:
    """Online with ``extract.backend: sglang`` needs the capture servers' URLs and capture folders (``ex``: the
    config's ``extract`` section)."""
    if (
        hidden_states == "online"
        and ex.backend == "sglang"
        and (not ex.sglang_url or not ex.capture_dir)
    ):
        raise UserError(
            "extract.sglang_url / extract.capture_dir: required for train.hidden_states: online "
            "with extract.backend: sglang (the capture servers 04 trains from)"
        )


def check_hidden_states(hidden_states: str, extract, shards_dir: Path, data_config: dict) -> None:
    """Refuse offline training on token-only samples, and online training from capture servers the config does not
    name, before 04 writes or reads anything heavy (the verifier head's extraction takes minutes for Kimi-K2.5).

    Args:
        hidden_states: ``train.hidden_states``; extract: the config's ``extract`` section; shards_dir: 02's folder.

    Raises:
        UserError: naming ``data_config.json``'s ``format`` and the two fixes, or the missing server keys.
    """
    if hidden_states == "offline" and is_token_only(data_config):
        raise UserError(
            f"{shards_dir / DATA_CONFIG}: key 'format' is {data_config['format']!r} (token-only "
            "samples, no hidden states); set train.hidden_states: online, or re-run 02 with offline"
        )
    _require_servers(hidden_states, extract)


def unused_shard_states_note(
    hidden_states: str, backend: str, shards_dir: Path, data_config: dict
) -> Optional[str]:
    """The info line of online training over shards that hold the verifier's hidden states (02 ran offline), else
    None. Those states are not read: ``online`` asks for the verifier's states of each micro-batch (a user comparing
    online with offline on the same shards, or measuring online speed, gets what was asked for), and training from
    the shards is ``train.hidden_states: offline``, one key away; the line says so instead of recomputing silently.
    ``backend``: ``extract.backend``.
    """
    if hidden_states != "online" or is_token_only(data_config):
        return None
    return (
        f"train.hidden_states: online: {shards_dir} holds the verifier's hidden states too (format "
        f"{data_config.get('format')!r}, 02 ran offline); they are not read: online computes each micro-batch's "
        f"states with the verifier (extract.backend {backend}), as asked; set train.hidden_states: "
        f"offline to train from the shards without running the verifier"
    )


def state_source(
    hidden_states: str,
    verifier,
    extract,
    prefetch: int,
    shards_dir: Path,
    data_config: dict,
    device: torch.device,
    feat_dtype: torch.dtype,
):
    """The hidden-state source of ``hidden_states`` (``train.hidden_states``; see the module docstring): the shards,
    the ``verifier`` (the config's section) on ``device``, or the capture servers of ``extract`` (the config's
    section) with ``prefetch`` batches ahead (``train.online_prefetch``).

    Raises:
        UserError: offline training on token-only samples, or an online source that cannot start.
    """
    check_hidden_states(hidden_states, extract, shards_dir, data_config)
    if hidden_states == "offline":
        return ShardStates()
    if extract.backend == "sglang":
        return ServerStates.connect(extract, prefetch, data_config, device)
    return VerifierStates.load(verifier, data_config, device, feat_dtype)
