"""Loading the verifier (target) model, its tokenizer and configuration from a local folder (never a hub at run
time): an HF folder (``config.json`` + safetensors + tokenizer) or a folder holding ``verifier.gguf_file``
(transformers dequantises it; needs ``gguf``). Shapes come from the text model (:func:`eagle3.verifier.arch.text_config`
unwraps multimodal wrappers such as Kimi-K2.5).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import weakref
from pathlib import Path
from typing import Annotated, Any, Iterable, Optional, Protocol, Union

import torch
from pydantic import BaseModel, BeforeValidator, Field, StrictInt
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL_LM_CLASSES,
)

from eagle3.errors import UserError, validated
from eagle3.io import read_json
from eagle3.verifier.arch import cfg_get, drafter_head_dim, text_config

log = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")
"""x86 CPU flags (``/proc/cpuinfo`` names) of bfloat16 matrix instructions (AVX512-BF16, AMX-BF16)."""


class VerifierSpec(Protocol):
    """Where and how to load a verifier: the fields this module reads (the run config's ``verifier`` section
    has them).

    Attributes:
        gguf_file: a GGUF file name inside the folder, or None for an HF folder.
        trust_remote_code: pass ``trust_remote_code=True`` to transformers.
        dtype: ``auto`` (:func:`resolve_dtype`) | ``bfloat16`` | ``float16`` | ``float32``.
        device: ``auto`` | ``cpu`` | ``cuda[:i]``.
    """

    gguf_file: Optional[str]
    trust_remote_code: bool
    dtype: str
    device: str

    def resolved_path(self) -> Path:
        """The verifier folder (raises UserError when it cannot be resolved)."""
        ...


# ---------------------------------------------------------------------------------------------
# paths and devices
# ---------------------------------------------------------------------------------------------
def _check_files(vcfg: VerifierSpec) -> Path:
    """The verifier folder.

    Raises:
        UserError: naming the field to fix: the folder itself is missing, ``verifier.gguf_file`` inside it, or (no
            GGUF file set) its ``config.json``.
    """
    path = vcfg.resolved_path()
    gguf = path / vcfg.gguf_file if vcfg.gguf_file else None
    if not path.is_dir():
        missing = f"verifier.path: folder '{path}' not found"
    elif gguf is not None:
        missing = None if gguf.is_file() else f"verifier.gguf_file: '{gguf}' not found"
    elif not (path / "config.json").is_file():
        missing = (
            f"verifier.path: '{path}' has no config.json (set verifier.gguf_file for a GGUF model)"
        )
    else:
        missing = None
    if missing is not None:
        raise UserError(missing)
    return path


_FINGERPRINT_CHUNK = 1 << 20  # bytes read from the middle of each weight file


def weights_fingerprint(vcfg: VerifierSpec) -> Optional[str]:
    """A content fingerprint of the verifier's weight files (key :data:`WEIGHTS_KEY` in 02's ``data_config.json``
    and 01's settings): sha256 over each file transformers loads (``verifier.gguf_file``, else every
    ``*.safetensors`` in the folder, else every ``pytorch_model*.bin``) of its name, size and 1 MiB from its middle.

    Returns:
        ``sha256:<hex>``, or None when the folder holds no weight file or is not on this machine.
    """
    try:
        folder = vcfg.resolved_path()
    except UserError:  # a package: path whose package is not installed here
        return None
    if vcfg.gguf_file:
        files = [folder / vcfg.gguf_file]
    else:  # no folder: globs find nothing
        files = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("pytorch_model*.bin"))
    files = [f for f in files if f.is_file()]
    if not files:
        return None
    h = hashlib.sha256()
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.name}\0{size}\0".encode())
        with open(f, "rb") as fh:
            fh.seek(max(0, size // 2 - _FINGERPRINT_CHUNK // 2))
            h.update(fh.read(_FINGERPRINT_CHUNK))
    return "sha256:" + h.hexdigest()


WEIGHTS_KEY = "verifier_weights"


def weights_differ(recorded: Optional[str], now: Optional[str]) -> bool:
    """THE rule for comparing two :func:`weights_fingerprint` values, for every record that holds one: a mismatch
    only when both are set (not None or empty) and differ; a side without one has nothing to compare."""
    return bool(recorded) and bool(now) and recorded != now


def weights_record(vcfg: VerifierSpec) -> dict:
    """``{"verifier_weights": fingerprint}`` for a record of the model it was made with, ``{}`` without one."""
    fp = weights_fingerprint(vcfg)
    return {WEIGHTS_KEY: fp} if fp else {}


def _hf_kwargs(vcfg: VerifierSpec) -> dict:
    """Keyword arguments of every ``from_pretrained`` call; ``trust_remote_code`` only when the config asks."""
    kw: dict[str, Any] = {}
    if vcfg.gguf_file:
        kw["gguf_file"] = vcfg.gguf_file
    if vcfg.trust_remote_code:
        kw["trust_remote_code"] = True
    return kw


def resolve_device(device: Optional[Union[str, torch.device]]) -> torch.device:
    """``None``/``"auto"`` -> ``cuda`` if available else ``cpu``; anything else -> ``torch.device(device)``.

    Raises:
        UserError: an unparsable device, or a CUDA device this machine does not have (naming ``verifier.device``).
    """
    if device is None or str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        dev, fault = None, f"invalid device '{device}'"
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if dev is not None and (dev.type != "cuda" or (dev.index or 0) < n):
        return dev
    if dev is not None:  # a CUDA device this machine does not have: the ones it has and the fix
        has = (
            f"{n} CUDA device{'s' if n != 1 else ''} (cuda:0..cuda:{n - 1}); set verifier.device: auto or one of them"
            if n
            else f"no CUDA (torch {torch.__version__}, torch.cuda.is_available() is False); set verifier.device: "
            "auto (cuda when there is one, else cpu) or cpu"
        )
        fault = f"'{device}', but this machine has {has}"
    raise UserError(f"verifier.device: {fault}")


def cpu_flags(path: str | Path = "/proc/cpuinfo") -> frozenset[str]:
    """The CPU's feature flags: the first ``flags`` line of ``/proc/cpuinfo``; empty where there is none (not Linux,
    not x86)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags") and ":" in line:
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_auto_dtype(flags: Iterable[str]) -> str:
    """``verifier.dtype: auto`` on a CPU with these feature ``flags`` (:func:`cpu_flags`): ``bfloat16`` where it has
    bf16 instructions (any of :data:`BF16_CPU_FLAGS`), else ``float32`` (bf16 would be emulated, several times
    slower)."""
    return "bfloat16" if set(flags) & set(BF16_CPU_FLAGS) else "float32"


def resolve_dtype(
    dtype: str, device: torch.device, flags: Optional[Iterable[str]] = None
) -> tuple[str, str]:
    """``(name, why)``: the dtype the verifier loads in on ``device`` and why. ``verifier.dtype`` as set, or for
    ``auto``: :func:`cpu_auto_dtype` of ``flags`` (default :func:`cpu_flags`) on a CPU, ``bfloat16`` on any other
    device (CUDA: the serving dtype)."""
    if dtype != "auto":
        return dtype, "verifier.dtype"
    if device.type != "cpu":
        return "bfloat16", f"verifier.dtype auto on {device.type}"
    flags = cpu_flags() if flags is None else frozenset(flags)
    have = [f for f in BF16_CPU_FLAGS if f in flags]
    why = (
        f"verifier.dtype auto: the CPU has {', '.join(have)}"
        if have
        else f"verifier.dtype auto: the CPU has none of {', '.join(BF16_CPU_FLAGS)} (bf16 would be emulated)"
    )
    return cpu_auto_dtype(flags), why


def _from_pretrained(what: str, loader, path: Path, **kw):
    """``loader.from_pretrained(path, **kw)``; UserError naming ``verifier.path`` and ``what`` when it fails."""
    try:
        return loader.from_pretrained(str(path), **kw)
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"verifier.path: cannot load the {what} from '{path}': {first}") from e


# ---------------------------------------------------------------------------------------------
# tokenizer, config, model
# ---------------------------------------------------------------------------------------------
def load_tokenizer(vcfg: VerifierSpec):
    """The verifier's tokenizer, its pad token the EOS token when it has none (pads are masked), its stop ids
    registered (:func:`register_stop_ids`).

    Raises:
        UserError: missing folder/files, or a tokenizer transformers cannot load.
    """
    tok = _from_pretrained("tokenizer", AutoTokenizer, _check_files(vcfg), **_hf_kwargs(vcfg))
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    register_stop_ids(tok, config_eos_ids(vcfg))
    return tok


# ---------------------------------------------------------------------------------------------
# the verifier's stop set
# ---------------------------------------------------------------------------------------------
END_OF_TURN_TOKENS = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|end_of_text|>",
)
"""Special tokens that end an assistant turn in common chat templates (ChatML/Kimi, Llama 3 incl.
Llama-3.1's ``<|eom_id|>`` after a tool call, Phi-3, Gemma, GPT-2 style, Llama 2); only those in the
tokenizer's vocab are used."""
_STOP_IDS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _as_list(value: Any) -> Any:
    return [value] if isinstance(value, int) and not isinstance(value, bool) else value


class EosIds(BaseModel):
    """``eos_token_id`` of a ``config.json`` / ``generation_config.json`` (or its ``text_config``): an id or a list."""

    eos_token_id: Annotated[list[Annotated[StrictInt, Field(ge=0)]], BeforeValidator(_as_list)] = []


def config_eos_ids(vcfg: VerifierSpec) -> set[int]:
    """The stop ids a serving engine takes from the verifier folder: the union of ``eos_token_id`` (an id or a list)
    of ``config.json`` (top level and ``text_config``) and ``generation_config.json``, as SGLang 0.5.23
    ``ModelConfig._get_hf_eos_token_id`` and HF ``generate`` take them; absent files contribute nothing.

    Raises:
        UserError: a file that is not JSON or an ``eos_token_id`` that is not ids, naming the file.
    """
    path = vcfg.resolved_path()
    out: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        f = path / name
        if not f.is_file():
            continue
        raw = read_json(f)  # file:line: malformed JSON / not UTF-8 text
        if not isinstance(raw, dict):
            continue
        for sub in (raw, raw.get("text_config")):
            if isinstance(sub, dict) and sub.get("eos_token_id") is not None:
                ids = validated(EosIds, sub, str(f), "a token id or a list of token ids")
                out |= set(ids.eos_token_id)
    return out


def register_stop_ids(tokenizer, ids: Iterable[int]) -> frozenset[int]:
    """The tokenizer's built-in stop ids | ``ids`` (the verifier folder's, :func:`config_eos_ids`), attached to the
    tokenizer object for :func:`stop_token_ids` (not when it is not weak-referenceable)."""
    stop = frozenset(_builtin_stop_ids(tokenizer) | {int(i) for i in ids})
    with contextlib.suppress(TypeError):
        _STOP_IDS[tokenizer] = stop
    return stop


def _builtin_stop_ids(tokenizer) -> set[int]:
    ids: set[int] = set()
    eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif isinstance(eos, (list, tuple)):
        ids.update(int(i) for i in eos)
    vocab = tokenizer.get_vocab()
    for t in END_OF_TURN_TOKENS:
        if t in vocab:
            ids.add(int(vocab[t]))
    return ids


def stop_token_ids(tokenizer) -> set[int]:
    """THE verifier's stop set (a new ``set[int]``), for every reader (01's regeneration stop, 02's loss-mask turn
    end, 05's decoding stop): the tokenizer's EOS id(s) | the :data:`END_OF_TURN_TOKENS` in its vocab | for a
    tokenizer from :func:`load_tokenizer`, :func:`config_eos_ids`. Cached per tokenizer object."""
    try:
        return set(_STOP_IDS[tokenizer])
    except (KeyError, TypeError):
        return set(register_stop_ids(tokenizer, ()))


def load_verifier_config(vcfg: VerifierSpec):
    """The verifier's ``transformers.PretrainedConfig`` (no weights; GGUF too). A ``model_type`` transformers does not
    know (Kimi-K2.5 without remote code) gives ``config.json`` as a plain ``PretrainedConfig``.

    Raises:
        UserError: missing folder/files, or malformed ``config.json``.
    """
    path = _check_files(vcfg)
    try:
        return AutoConfig.from_pretrained(str(path), **_hf_kwargs(vcfg))
    except (ValueError, KeyError, OSError) as e:
        if vcfg.gguf_file:
            raise UserError(
                f"verifier.gguf_file: cannot read the config of '{path / vcfg.gguf_file}': {e}"
            ) from e
        cfg_file = path / "config.json"
        raw = read_json(cfg_file)  # file:line: malformed JSON / not UTF-8 text
        log.warning(
            "transformers cannot build the config of %s (%s); reading config.json as plain data",
            path,
            str(e).splitlines()[0] if str(e) else type(e).__name__,
        )
        return PretrainedConfig(**raw)


# transformers' GGUF quantizer warns on every load in a dtype other than float32; the dtype is chosen (verifier.dtype,
# auto: resolve_dtype, whose choice load_verifier logs), so that note is dropped.
_GGUF_DTYPE_NOTE = "Loading a GGUF checkpoint with its weights packed is fastest in float32"
_GGUF_LOGGER = "transformers.quantizers.quantizer_gguf"


def _not_gguf_dtype_note(record: logging.LogRecord) -> bool:
    """A logging filter: False for transformers' "GGUF is fastest in float32" warning (:data:`_GGUF_DTYPE_NOTE`)."""
    return not str(record.getMessage()).startswith(_GGUF_DTYPE_NOTE)


@contextlib.contextmanager
def _gguf_dtype_note_silenced(vcfg: VerifierSpec, dtype: str):
    """While loading a GGUF verifier in ``dtype`` != float32: transformers' float32 note is filtered out of its
    logger (see :data:`_GGUF_DTYPE_NOTE`)."""
    if not vcfg.gguf_file or dtype == "float32":
        yield
        return
    logger = logging.getLogger(_GGUF_LOGGER)
    logger.addFilter(_not_gguf_dtype_note)
    try:
        yield
    finally:
        logger.removeFilter(_not_gguf_dtype_note)


def load_verifier(vcfg: VerifierSpec, device: Optional[Union[str, torch.device]] = None):
    """Load the verifier model (eval mode, ``vcfg.dtype``; ``auto`` decided here by :func:`resolve_dtype` and
    logged in one line) and its tokenizer.

    Args:
        vcfg: the ``verifier`` section of the run config.
        device: overrides ``vcfg.device``; ``"auto"``/None -> cuda if available else cpu.

    Returns:
        ``(model, tokenizer)``: an ``AutoModelForCausalLM`` in eval mode on ``device``, and the
        tokenizer of :func:`load_tokenizer`.

    Raises:
        UserError: missing folder/files or a model transformers cannot build.
    """
    path = _check_files(vcfg)
    dev = resolve_device(device if device is not None else vcfg.device)
    tok = load_tokenizer(vcfg)
    dtype, why = resolve_dtype(vcfg.dtype, dev)
    if vcfg.dtype == "auto":
        log.info("verifier in %s on %s (%s)", dtype, dev, why)
    with _gguf_dtype_note_silenced(vcfg, dtype):
        model = _from_pretrained(
            "model", AutoModelForCausalLM, path, dtype=_DTYPES[dtype], **_hf_kwargs(vcfg)
        )
    model.to(dev)
    model.eval()
    gen = getattr(model, "generation_config", None)
    if gen is not None and gen.pad_token_id is None:
        gen.pad_token_id = tok.pad_token_id
    return model, tok


# ---------------------------------------------------------------------------------------------
# shapes
# ---------------------------------------------------------------------------------------------
def _rope_theta(cfg: Any) -> Optional[float]:
    """``rope_theta`` (transformers <5 and most remote code) or ``rope_parameters['rope_theta']`` (transformers 5)."""
    theta = cfg_get(cfg, "rope_theta")
    if theta is None:
        params = cfg_get(cfg, "rope_parameters") or {}
        if isinstance(params, dict):
            theta = params.get("rope_theta")
            if theta is None and params:  # per-layer-type dict, e.g. {"full_attention": {...}}
                first = next(iter(params.values()))
                theta = first.get("rope_theta") if isinstance(first, dict) else None
    return float(theta) if theta is not None else None


CONTEXT_LENGTH_KEYS = (
    "max_sequence_length",
    "seq_length",
    "max_seq_len",
    "model_max_length",
    "max_position_embeddings",
)
"""Config keys a context length is read from, first present wins (SGLang 0.5.23
``sglang/srt/utils/hf_transformers/common.py`` ``CONTEXT_LENGTH_KEYS``)."""


def serving_context_length(cfg: Any) -> Optional[int]:
    """The context length (tokens) SGLang derives from a (text) model config: the first of
    :data:`CONTEXT_LENGTH_KEYS` times the rope scaling ``factor``, where the factor counts only
    without ``original_max_position_embeddings`` and for rope types other than ``llama3``
    (SGLang 0.5.23 ``get_context_length``). ``rope_scaling`` or (transformers 5) a non-default
    ``rope_parameters`` is read. ``None`` when no key is present (SGLang then assumes 2048).

    Args:
        cfg: ``transformers.PretrainedConfig`` or ``config.json`` dict (already unwrapped with
            :func:`text_config`), or an exported drafter's ``config.json``.
    """
    rs = cfg_get(cfg, "rope_scaling")
    if not rs:
        rp = cfg_get(cfg, "rope_parameters")
        rs = rp if isinstance(rp, dict) and rp.get("rope_type", "default") != "default" else None
    factor = 1.0
    if isinstance(rs, dict) and rs:
        factor = float(rs.get("factor", 1) or 1)
        if "original_max_position_embeddings" in rs or rs.get("rope_type") == "llama3":
            factor = 1.0
    for key in CONTEXT_LENGTH_KEYS:
        v = cfg_get(cfg, key)
        if v is not None:
            return int(factor * int(v))
    return None


def verifier_dims(hf_config: Any) -> dict:
    """The verifier shapes the pipeline needs, read from the text model's config.

    Args:
        hf_config: ``transformers.PretrainedConfig`` or ``config.json`` dict (wrappers unwrapped
            with :func:`text_config`).

    Returns:
        dict with ``num_layers`` (decoder layers N; HF returns N+1 hidden states), ``hidden_size``, ``vocab_size``,
        ``architecture`` (the top-level ``architectures[0]``; for GGUF configs transformers' causal-LM class of the
        model type), ``model_type`` (of the text model), ``rms_norm_eps``, ``rope_theta`` (None if absent),
        ``num_attention_heads``, ``num_key_value_heads`` (default: the head count), ``head_dim``
        (:func:`eagle3.verifier.arch.drafter_head_dim`), ``intermediate_size`` (the dense MLP width) and
        ``max_position_embeddings``.

    Raises:
        UserError: a required field (num_hidden_layers, hidden_size, vocab_size, num_attention_heads) is missing.
    """
    top = hf_config
    tc = text_config(hf_config)
    out: dict[str, Any] = {}
    for key, name in (
        ("num_layers", "num_hidden_layers"),
        ("hidden_size", "hidden_size"),
        ("vocab_size", "vocab_size"),
        ("num_attention_heads", "num_attention_heads"),
    ):
        v = cfg_get(tc, name)
        if v is None and name == "vocab_size":
            v = cfg_get(top, "vocab_size")
        if v is None:
            raise UserError(f"verifier config: missing field '{name}' in the text model config")
        out[key] = int(v)
    archs = cfg_get(top, "architectures") or cfg_get(tc, "architectures") or [None]
    out["model_type"] = cfg_get(tc, "model_type")
    out["architecture"] = archs[0] or CAUSAL_LM_CLASSES.get(
        out["model_type"]
    )  # GGUF: no architectures
    out["rms_norm_eps"] = float(
        cfg_get(tc, "rms_norm_eps", cfg_get(tc, "layer_norm_eps", 1e-6)) or 1e-6
    )
    out["rope_theta"] = _rope_theta(tc)
    heads = out["num_attention_heads"]
    out["num_key_value_heads"] = int(cfg_get(tc, "num_key_value_heads") or heads)
    out["head_dim"] = drafter_head_dim(tc, out["hidden_size"], heads)
    out["intermediate_size"] = int(cfg_get(tc, "intermediate_size") or 4 * out["hidden_size"])
    mpe = cfg_get(tc, "max_position_embeddings")
    out["max_position_embeddings"] = int(mpe) if mpe is not None else None
    return out
