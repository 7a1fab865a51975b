"""Build stage 02's capture backend from the ``verifier`` and ``extract`` config sections."""

from __future__ import annotations

from typing import Optional

from eagle3.capture.hf import HFCapture
from eagle3.capture.multi import sglang_backend
from eagle3.engines.layers import check_aux_layers, check_servable, default_aux_layers
from eagle3.errors import UserError

#: The ``extract`` fields backend sglang cannot run without, in the order they are checked, and what each is for.
SGLANG_REQUIRED = {
    "sglang_url": "or pass --server URL [URL ...]",
    "capture_dir": "where the patched server writes tensors",
}


def make_backend(verifier, extract, aux_layers: Optional[list[int]] = None):
    """``(backend, tokenizer)`` for ``extract.backend``: ``hf`` loads the verifier in-process,
    ``sglang`` loads the tokenizer and talks to ``extract.sglang_url``. ``verifier``, ``extract``:
    the run config's sections.

    Raises:
        UserError: missing ``extract.sglang_url`` / ``extract.capture_dir``.
    """
    # looked up at call time: tests replace eagle3.verifier's loaders
    from eagle3.verifier.load import (
        load_tokenizer,
        load_verifier,
        load_verifier_config,
        verifier_dims,
    )

    ex = extract
    if ex.backend == "hf":
        model, tok = load_verifier(verifier)
        config = model.config
    else:
        for key, why in SGLANG_REQUIRED.items():
            if not getattr(ex, key):
                raise UserError(f"extract.{key}: required for backend sglang ({why})")
        tok, config = load_tokenizer(verifier), load_verifier_config(verifier)
    n = verifier_dims(config)["num_layers"]
    layers = resolve_aux(ex.aux_layers if aux_layers is None else aux_layers, n)
    if ex.backend == "hf":
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        return HFCapture(model, layers, batch_tokens=ex.batch_tokens, pad_id=pad), tok
    return sglang_backend(
        ex.sglang_url,
        ex.capture_dir,
        layers,
        timeout=ex.sglang_timeout_s,
        max_length=ex.max_length,
        max_requests=ex.requests_per_batch,
        per_server=ex.batches_in_flight_per_server,
        max_failures=ex.server_max_failures,
    ), tok


def resolve_aux(layers: Optional[list[int]], num_layers: int) -> list[int]:
    """The aux layer ids to capture: ``layers`` checked against ``num_layers``, or the EAGLE default
    ``[2, N//2, N-3]`` (None). Raises UserError naming ``extract.aux_layers``."""
    if layers is None:
        layers, default = default_aux_layers(num_layers), " (default [2, N//2, N-3])"
    else:
        default = ""
    return check_aux_layers(layers, num_layers, field="extract.aux_layers" + default)


def checked_backend(verifier, extract, engine: str, backend, tokenizer) -> tuple:
    """``(backend, tokenizer, info, aux layers)`` of the given backend (with its tokenizer) or
    :func:`make_backend`'s, its layers checked against ``extract.aux_layers`` and ``engine``.

    Raises:
        ValueError: a backend without tokenizer, or other layers than ``extract.aux_layers``.
        UserError: layers the engine cannot serve.
    """
    if backend is None:
        backend, tokenizer = make_backend(verifier, extract)
    elif tokenizer is None:
        raise ValueError("run(): pass the tokenizer together with the backend")
    info = backend.info()
    aux = resolve_aux(list(backend.aux_layers), info["num_layers"])
    if extract.aux_layers is not None and aux != list(extract.aux_layers):
        raise ValueError(f"backend captures {aux} but extract.aux_layers is {extract.aux_layers}")
    check_servable(aux, engine, str(info["architecture"]), "extract.aux_layers")
    return backend, tokenizer, info, aux


def shard_expect(info: dict, storage_dtype: str, *, tokens_only: bool) -> dict:
    """What every shard of the run must hold (:func:`eagle3.shards.read.load_sample`'s ``expect``), from the
    backend's ``info()`` and the storage dtype."""
    if tokens_only:
        return {"vocab_size": info["vocab_size"], "tokens_only": True}
    return {
        "hidden_size": info["hidden_size"],
        "num_hidden_states": 4,
        "vocab_size": info["vocab_size"],
        "storage_dtype": storage_dtype,
    }
