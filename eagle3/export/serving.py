"""Export a trained drafter as a folder SGLang or vLLM serves, and load such a folder back.

Each engine takes its own folder (``04_train.py --export-only --engine sglang|vllm`` writes either
from the same checkpoint). The two differ in the aux-layer ids they state, and a folder served by
the other engine loads without error but captures the wrong verifier layers:

- ``sglang`` (also SpecForge) -> serve with SGLang only:
  ``config.json`` = LlamaConfig fields + ``architectures: ["LlamaForCausalLMEagle3"]``,
  ``num_hidden_layers`` (= ``num_layers``, 1 by default), ``draft_vocab_size``, ``target_hidden_size`` and
  ``eagle_config: {eagle_aux_hidden_state_layer_ids, use_aux_hidden_state: true}`` with SGLang ids
  (:func:`eagle3.layers.engine_layer_ids`: HF index - 1 for Llama-family verifiers, the HF index
  for DeepSeek/Kimi ones); ``model.safetensors`` with keys :data:`SGLANG_KEYS`. vLLM would load
  these weights too, but reads the ``eagle_config`` ids as HF indices: one layer off for Llama.
- ``vllm`` (vLLM speculators format, read by ``vllm/transformers_utils/configs/speculators``) ->
  serve with vLLM only: ``config.json`` = ``architectures: ["Eagle3Speculator"]``,
  ``speculators_model_type: "eagle3"``, ``transformer_layer_config`` (a LlamaConfig dict),
  ``draft_vocab_size``, ``target_hidden_size``, ``norm_before_residual: false`` (written
  explicitly: vLLM's default when absent is true, which is not this drafter), top-level
  ``eagle_aux_hidden_state_layer_ids`` (vLLM ids = HF indices) and ``speculators_config`` (greedy
  proposal with ``speculative_tokens``, the verifier's ``name_or_path`` and architecture).
  Weights use the speculators names: ``layers.0.`` instead of ``midlayer.``, the rest as in
  SGLang (vLLM drops ``t2d`` at load; it is kept for round trips), except that a full-vocab drafter
  (``draft_vocab_size`` = the verifier's vocab) has neither ``d2t`` nor ``t2d``: vLLM's loader
  refuses ``d2t`` then (:func:`writes_vocab_map`). SGLang cannot load it.

Deeper drafters (``DrafterArgs.num_layers`` = ``num_hidden_layers`` in both configs, eagle3/train/model.py "Depth"):
layer 0 keeps its names (``midlayer.`` / ``layers.0.``); each layer ``i >= 1`` adds :func:`upper_layer_keys` in both
formats (SGLang 0.5.23's loader maps only ``midlayer.`` to ``layers.0.`` and loads ``layers.{i}.*`` as named; vLLM's
``AutoWeightsLoader`` the same). Its pre-attention norm is written twice, as ``layers.{i}.hidden_norm.weight`` (what
SGLang applies) and ``layers.{i}.input_layernorm.weight`` (what vLLM applies): each engine creates both modules and
leaves the other unused. :func:`load_exported` requires both and loads the one the folder's engine applies
(:data:`ENGINE_UPPER_NORM`), warning when they differ.

EAGLE-3.1 drafters (``DrafterArgs.variant == "eagle3.1"``, eagle3/train/model.py) add the tensors
``fc_norm.{0,1,2}.weight`` (same names in both engines) and the top-level config keys
``fc_norm: true`` and ``norm_output: true``, which SGLang 0.5.23 reads from the draft config
(``llama_eagle3.py`` ``LlamaModel.__init__``) and vLLM 0.33 copies from the speculators config
(``speculators/algos.py`` ``update_eagle3``) into the model config its ``llama_eagle3.py`` reads.
:data:`VARIANT_ENGINES` lists which engine serves which variant; an export for an engine not listed
is refused (one line naming the engine). An engine release whose model code predates these keys
would load such a folder as EAGLE-3.0 (SGLang's loader skips unknown tensors): serve 3.1 folders
with the versions named there or newer.

Both ``config.json`` also carry an ``eagle3_train`` block (:data:`CONFIG_BLOCK`: ``engine``,
``aux_layers_hf``, ``engine_layer_ids``, ``layer_id_convention``, the verifier architecture) that
makes a folder used by the wrong engine, or ids edited by hand, detectable
(:func:`check_export_folder`, used by :func:`load_exported`, stage 05 and the server benchmark),
and ``torch_dtype`` / ``dtype`` = the weights' dtype (bfloat16 unless asked otherwise, also for a
float32 verifier, :func:`export_dtype`: SGLang 0.5.23 ``--dtype auto`` serves a float32 draft
config as float16, ``_get_and_verify_dtype``).
``eagle3_train.json`` holds our metadata (HF aux layers, engine, engine ids, verifier, drafter
args, and ``trained_from``: the provenance 04 passes, i.e. ``train_dir``, ``checkpoint``, ``step``,
``select_best``, ``selected_step``; replacing an export whose ``train_dir`` differs logs a warning). Embedding weights are omitted unless ``include_embeddings``; both engines then use the
verifier's, which requires equal hidden sizes (:func:`check_export_contract`). Folders are written
to a temporary sibling and renamed into place.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

import torch

from eagle3.data.vocab import check_vocab_map
from eagle3.errors import UserError
from eagle3.io import (
    atomic_write_json,
    disk_full_guard,
    exclusive_lock,
    file_mode,
    make_dirs,
    probe_dirs,
    read_json,
)
from eagle3.layers import (
    check_aux_layers,
    engine_layer_ids,
    hf_layers_from_engine,
    is_deepseek_family,
)
from eagle3.train.draft_config import (
    DEFAULT_EXPORT_DTYPE,
    EXPORT_META_FILE,
    check_context_length,
    llama_config,
)
from eagle3.train.model import VARIANTS, DrafterArgs, Eagle3Drafter

log = logging.getLogger(__name__)

META_FILE = EXPORT_META_FILE
WEIGHTS_FILE = "model.safetensors"
LAYER_KEYS = (
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "input_layernorm.weight",
    "hidden_norm.weight",
    "post_attention_layernorm.weight",
)
VOCAB_KEYS = ("d2t", "t2d")
HEAD_KEYS = ("fc.weight", "norm.weight", "lm_head.weight") + VOCAB_KEYS
FC_NORM_KEYS = tuple(f"fc_norm.{j}.weight" for j in range(3))
"""The extra tensors of an ``eagle3.1`` drafter (one RMSNorm weight ``[Ht]`` per aux state), both engines."""
VARIANT_ENGINES = {
    "eagle3": {"sglang": "SGLang llama_eagle3.py", "vllm": "vLLM llama_eagle3.py"},
    "eagle3.1": {
        "sglang": "SGLang 0.5.23 llama_eagle3.py (config keys fc_norm, norm_output)",
        "vllm": "vLLM 0.33 llama_eagle3.py + transformers_utils/configs/speculators/algos.py (fc_norm, norm_output)",
    },
}
"""Which engine serves which drafter variant, and the model code read to say so."""
SGLANG_KEYS = tuple(f"midlayer.{k}" for k in LAYER_KEYS) + HEAD_KEYS
"""Tensor names of the SGLang export (``embed_tokens.weight`` optional)."""
VLLM_KEYS = tuple(f"layers.0.{k}" for k in LAYER_KEYS) + HEAD_KEYS
"""Tensor names of the vLLM speculators export with a reduced draft vocab (``embed_tokens.weight``
optional; a full-vocab vLLM export has no ``d2t``/``t2d``, see :func:`writes_vocab_map`)."""
EMBED_KEY = "embed_tokens.weight"
VERIFIER_FIELDS = ("name", "architecture", "num_layers", "hidden_size", "vocab_size")
SGLANG_ARCH = "LlamaForCausalLMEagle3"
VLLM_ARCH = "Eagle3Speculator"
CONFIG_BLOCK = "eagle3_train"
"""Key of our block in an exported ``config.json`` (engine, HF aux layers, id convention)."""
EXPORT_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


UPPER_NORM_KEYS = ("input_layernorm.weight", "hidden_norm.weight")
"""The two names of the pre-attention norm of a decoder layer ``i >= 1`` (vLLM 0.33 reads ``input_layernorm``,
SGLang 0.5.23 ``hidden_norm``); an export writes the drafter's one weight (``layers.{i}.input_layernorm``) under both."""
ENGINE_UPPER_NORM = {"sglang": "hidden_norm.weight", "vllm": "input_layernorm.weight"}
"""Which of :data:`UPPER_NORM_KEYS` each engine's ``llama_eagle3.py`` applies in layers ``i >= 1``."""


def upper_layer_keys(num_layers: int) -> tuple[str, ...]:
    """Tensor names of decoder layers ``1..num_layers-1`` (same in both formats): ``layers.{i}.`` + :data:`LAYER_KEYS`
    (q/k/v ``[*, H]``; ``input_layernorm`` and ``hidden_norm`` hold the same weight, see :data:`UPPER_NORM_KEYS`)."""
    return tuple(f"layers.{i}.{k}" for i in range(1, int(num_layers)) for k in LAYER_KEYS)


def required_keys(engine: str, variant: str = "eagle3", num_layers: int = 1) -> tuple[str, ...]:
    """Tensor names an export for ``engine`` must hold (``embed_tokens.weight`` optional): :data:`SGLANG_KEYS`
    or :data:`VLLM_KEYS`, plus :data:`FC_NORM_KEYS` for ``eagle3.1`` and :func:`upper_layer_keys` for a deeper drafter."""
    base = SGLANG_KEYS if engine == "sglang" else VLLM_KEYS
    return base + (FC_NORM_KEYS if variant == "eagle3.1" else ()) + upper_layer_keys(num_layers)


def _state_key(key: str) -> str:
    """The drafter ``state_dict`` key an export key (either format) is written from: ``layers.0.`` -> ``midlayer.``,
    ``layers.{i}.hidden_norm`` (``i >= 1``) -> ``layers.{i}.input_layernorm``, the rest as is."""
    if key.startswith("layers.0."):
        return key.replace("layers.0.", "midlayer.", 1)
    if key.startswith("layers.") and key.endswith(".hidden_norm.weight"):
        return key[: -len("hidden_norm.weight")] + "input_layernorm.weight"
    return key


def check_engine_serves(engine: str, variant: str) -> None:
    """Refuse an export of a drafter ``variant`` for an ``engine`` that cannot serve it (:data:`VARIANT_ENGINES`).

    Raises:
        UserError: one line naming the engine and the variant.
    """
    if variant not in VARIANT_ENGINES:
        raise UserError(
            f"drafter variant '{variant}': unknown (expected one of {', '.join(VARIANTS)})"
        )
    serving = VARIANT_ENGINES[variant]
    if engine not in serving:
        raise UserError(
            f"export.engine: {engine} cannot serve an {variant} drafter (its EAGLE-3 model code has no "
            f"{variant} layers); export for {' or '.join(sorted(serving))}, or train with drafter.variant: eagle3"
        )


def _variant_keys(variant: str) -> dict:
    """The draft-config keys both engines read for ``variant`` (none for ``eagle3``: folders stay as before)."""
    return {"fc_norm": True, "norm_output": True} if variant == "eagle3.1" else {}


def export_dtype(name: str | torch.dtype, verifier_dtype: str = "bfloat16") -> torch.dtype:
    """The dtype an export is written in: ``export.dtype``; ``auto`` = the dtype the verifier is
    SERVED in: ``verifier.dtype``, except that a float32 verifier gives bfloat16.

    ``verifier.dtype: float32`` is this project's exactness setting (CPU checks, fatal lossless
    checks in 05), not a serving dtype: SGLang 0.5.23's ``--dtype auto`` turns a float32 draft
    config into float16 (``sglang/srt/configs/model_config.py`` ``_get_and_verify_dtype``: "we use
    float16 for float32 models"), a dtype the drafter never ran in, and vLLM 0.33 casts the draft
    to the verifier's serving dtype anyway (``SpeculativeConfig``: draft ``dtype`` =
    ``target_model_config.dtype``); the float32 file is then only twice the size. An explicit
    ``float32`` is written as asked (:func:`export_drafter` warns for SGLang).

    Raises:
        UserError: an unknown dtype name.
    """
    if isinstance(name, torch.dtype):
        if name not in EXPORT_DTYPES.values():
            raise UserError(f"export.dtype: {name} is not one of {sorted(EXPORT_DTYPES)}")
        return name
    if name == "auto" and verifier_dtype == "float32":
        log.info(
            "export.dtype auto with verifier.dtype float32: exporting bfloat16, the serving dtype "
            "(set export.dtype: float32 to keep float32 weights)"
        )
        return torch.bfloat16
    key = verifier_dtype if name == "auto" else name
    if key not in EXPORT_DTYPES:
        raise UserError(
            f"export.dtype: unknown dtype {key!r} (expected auto, {', '.join(sorted(EXPORT_DTYPES))})"
        )
    return EXPORT_DTYPES[key]


def writes_vocab_map(engine: str, draft_vocab_size: int, target_vocab_size: int) -> bool:
    """Whether the ``engine`` folder carries ``d2t``/``t2d`` (what each engine's EAGLE-3 loader accepts).

    - vLLM 0.33 (``vllm/model_executor/models/llama_eagle3.py``, ``Eagle3LlamaForCausalLM``):
      ``__init__`` creates the ``draft_id_to_target_id`` parameter only when the config's
      ``draft_vocab_size`` differs from the verifier's vocab (``model_config.get_vocab_size()``);
      ``load_weights`` renames ``d2t`` to it and skips ``t2d``. So a full-vocab folder that carries
      ``d2t`` is refused (``There is no module or parameter named 'draft_id_to_target_id'``), and a
      reduced-vocab folder without it keeps the zero-initialised parameter: every draft id is taken
      for the target id of the same number (silently wrong drafts). -> written iff draft_V < target_V.
    - SGLang 0.5.23 (``sglang/srt/models/llama_eagle3.py``, ``LlamaForCausalLMEagle3.load_weights``):
      ``hot_token_id = d2t + arange`` when ``d2t`` is present, ``t2d`` skipped; without ``d2t`` the
      draft ids are used as target ids. A full-vocab ``d2t`` is all zeros (identity, accepted).
      -> always written (required for draft_V < target_V, harmless otherwise).
    """
    return engine == "sglang" or int(draft_vocab_size) != int(target_vocab_size)


def layer_id_convention(engine: str, architecture: str) -> str:
    """How ``engine`` turns the draft config's aux-layer ids into verifier layers (recorded in exports)."""
    if engine == "vllm":
        return "hf: ids are HF hidden_states indices (vLLM uses them as given)"
    if is_deepseek_family(architecture):
        return "sglang-deepseek: ids are HF hidden_states indices (SGLang adds +1 only when the first id is 1)"
    return "sglang-llama: ids are HF hidden_states index - 1 (SGLang captures id + 1)"


def check_export_contract(
    drafter: Eagle3Drafter, verifier_info: dict, include_embeddings: bool
) -> None:
    """Check the drafter/verifier shape contract a serving engine relies on (and does not check).

    - verifier ``hidden_size`` = the drafter's ``target_hidden_size``; ``fc.weight`` is
      ``[H, 3 x target_hidden_size]`` (three aux states concatenated, SGLang ``llama_eagle3.py``
      ``fc = Linear(target_hidden_size * num_aux, hidden_size)``);
    - verifier ``vocab_size`` = ``target_vocab_size``; ``lm_head.weight`` is ``[draft_V, H]`` and
      the vocab map is valid for ``draft_V`` / ``target_V`` (:func:`eagle3.data.vocab.check_vocab_map`);
    - every other tensor has the shape the drafter args imply;
    - embeddings: SGLang 0.5.23 (``LlamaForCausalLM.set_embed``) replaces the draft embedding with
      the verifier's only when ``target_hidden_size == hidden_size``, otherwise it keeps the draft
      folder's ``embed_tokens.weight`` -- left at random init when the folder has none; vLLM shares
      the verifier's only when the shapes agree. So a drafter whose hidden size differs from the
      verifier's must be exported with ``include_embeddings=True``.

    Raises:
        UserError: naming the field or tensor, the shape found and the shape required.
    """
    a = drafter.args
    vh, vv = int(verifier_info["hidden_size"]), int(verifier_info["vocab_size"])
    if vh != a.target_hidden_size:
        raise UserError(
            f"verifier_info.hidden_size: {vh}, but the drafter was built for target_hidden_size "
            f"{a.target_hidden_size} (its fc reads 3 x target hidden)"
        )
    if vv != a.target_vocab_size:
        raise UserError(
            f"verifier_info.vocab_size: {vv}, but the drafter was built for target_vocab_size {a.target_vocab_size}"
        )
    sd = drafter.state_dict()
    with torch.device("meta"):
        ref = Eagle3Drafter(a).state_dict()
    why = {
        "fc.weight": f"[hidden_size, 3 x verifier hidden_size] = [{a.hidden_size}, 3 x {vh}]",
        "lm_head.weight": f"[draft_vocab_size, hidden_size] = [{a.draft_vocab_size}, {a.hidden_size}]",
        EMBED_KEY: f"[verifier vocab_size, hidden_size] = [{vv}, {a.hidden_size}]",
    }
    for key, want in ref.items():
        if key not in sd:
            continue  # reported by export_drafter as a missing required tensor
        if tuple(sd[key].shape) != tuple(want.shape):
            raise UserError(
                f"drafter tensor '{key}': shape {list(sd[key].shape)}, EAGLE-3 export needs "
                f"{why.get(key, list(want.shape))}"
            )
    check_vocab_map(
        sd["d2t"],
        sd["t2d"],
        "drafter vocab map",
        target_vocab_size=vv,
        draft_vocab_size=a.draft_vocab_size,
        draft_key="drafter draft_vocab_size",
        target_source="verifier_info.vocab_size",
    )
    if a.hidden_size != vh and not include_embeddings:
        raise UserError(
            f"drafter hidden_size {a.hidden_size} differs from the verifier hidden_size {vh}: the engines then "
            f"do not use the verifier's embedding and would run the draft with a random one; export with "
            f"include_embeddings=True (writes '{EMBED_KEY}')"
        )


def export_drafter(
    drafter: Eagle3Drafter,
    out_dir: str | os.PathLike,
    engine: str,
    aux_layers_hf: list[int],
    verifier_info: dict,
    include_embeddings: bool = False,
    num_speculative_tokens: int = 3,
    dtype: str | torch.dtype = DEFAULT_EXPORT_DTYPE,
    provenance: Optional[dict] = None,
    ttt_length: Optional[int] = None,
) -> Path:
    """Write ``drafter`` as a serving-engine folder (see the module docstring for both formats).

    Args:
        drafter: trained drafter (its ``d2t``/``t2d`` must be the run's vocab map).
        out_dir: destination folder (replaced if it exists).
        engine: ``"sglang"`` or ``"vllm"``; the folder is for that engine only.
        aux_layers_hf: the three aux layers as HF ``hidden_states`` indices (capture convention).
        verifier_info: ``{name, architecture, num_layers, hidden_size, vocab_size}``
            (``eagle3.verifier.verifier_dims`` + the verifier id), optionally ``context_length``
            (checked by :func:`check_context_length`).
        include_embeddings: also store ``embed_tokens.weight`` (required when the drafter's
            hidden size differs from the verifier's, see :func:`check_export_contract`).
        num_speculative_tokens: vLLM ``speculators_config.proposal_methods[0].speculative_tokens``.
        dtype: floating weights are cast to this dtype (``torch.bfloat16`` by default, the
            verifier's dtype in production; a name from :data:`EXPORT_DTYPES` is accepted) and it
            is recorded as ``torch_dtype``/``dtype`` in ``config.json``.
        provenance: where the weights come from (``train_dir``, ``checkpoint``, ``step``, ``select_best``,
            ``selected_step``; :func:`eagle3.train.report.export_provenance`), recorded as ``trained_from`` in
            ``eagle3_train.json`` only (``config.json``, which the engines read, is unchanged). Replacing an export
            recorded from another ``train_dir`` logs a warning (the folder is still replaced).
        ttt_length: the TTT steps (draft positions) the drafter was trained for (``train.ttt_length``), recorded as
            ``ttt_length`` in ``eagle3_train.json`` (05 warns when it drafts more; None: not recorded).

    Returns:
        The folder path.

    Raises:
        UserError: unknown engine or dtype, an engine that cannot serve the drafter's variant
            (:func:`check_engine_serves`), missing ``verifier_info`` field, aux layers invalid
            for the verifier, a broken shape contract (:func:`check_export_contract`), a draft
            context SGLang refuses (:func:`check_context_length`), or a required tensor missing.
    """
    if engine not in ("sglang", "vllm"):
        raise UserError(f"export.engine: unknown engine '{engine}' (expected sglang or vllm)")
    check_engine_serves(engine, drafter.args.variant)
    out_dtype = export_dtype(dtype)
    if engine == "sglang" and out_dtype == torch.float32:
        log.warning(
            "export.dtype float32 for SGLang: its --dtype auto serves a float32 draft config as float16 "
            "(ModelConfig._get_and_verify_dtype); launch the server with --dtype bfloat16/float32, or export "
            "with export.dtype: auto (bfloat16)"
        )
    for f in VERIFIER_FIELDS:
        if f not in verifier_info or verifier_info[f] is None:
            raise UserError(f"verifier_info: missing field '{f}'")
    a = drafter.args
    arch = str(verifier_info["architecture"])
    aux = check_aux_layers(aux_layers_hf, int(verifier_info["num_layers"]), field="aux_layers_hf")
    check_export_contract(drafter, verifier_info, include_embeddings)
    check_context_length(a, verifier_info.get("context_length"), engine)
    ids = engine_layer_ids(aux, engine, arch)

    sd = drafter.state_dict()
    required = required_keys(engine, a.variant, a.num_layers)
    if not writes_vocab_map(engine, a.draft_vocab_size, a.target_vocab_size):
        required = tuple(k for k in required if k not in VOCAB_KEYS)  # full vocab: vLLM refuses d2t
    tensors: dict[str, torch.Tensor] = {}
    for key in required:
        src = _state_key(key)
        if src not in sd:
            raise UserError(f"drafter state: missing required tensor '{src}' (export key '{key}')")
        tensors[key] = sd[src]
    if include_embeddings:
        tensors[EMBED_KEY] = sd[EMBED_KEY]
    tensors = {
        k: (v.to(out_dtype) if v.is_floating_point() else v).detach().cpu().contiguous().clone()
        for k, v in tensors.items()
    }

    llama = llama_config(a, out_dtype)
    block = {
        "format_version": 1,
        "engine": engine,
        "serve_with": f"{'SGLang' if engine == 'sglang' else 'vLLM'} only (the other engine reads these layer ids "
        f"in another convention; export with --engine {'vllm' if engine == 'sglang' else 'sglang'})",
        "aux_layers_hf": aux,
        "engine_layer_ids": ids,
        "layer_id_convention": layer_id_convention(engine, arch),
        "verifier_architecture": arch,
        "verifier_num_layers": int(verifier_info["num_layers"]),
        "variant": a.variant,
    }
    if engine == "sglang":
        config = {
            "architectures": [SGLANG_ARCH],
            **llama,
            "draft_vocab_size": a.draft_vocab_size,
            "target_hidden_size": a.target_hidden_size,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
            **_variant_keys(a.variant),
            CONFIG_BLOCK: block,
        }
    else:
        config = {
            "architectures": [VLLM_ARCH],
            "speculators_model_type": "eagle3",
            "speculators_version": "0.1.0",
            "transformer_layer_config": {"architectures": ["LlamaForCausalLM"], **llama},
            "draft_vocab_size": a.draft_vocab_size,
            "target_hidden_size": a.target_hidden_size,
            "norm_before_residual": False,
            **_variant_keys(a.variant),
            "eagle_aux_hidden_state_layer_ids": ids,
            "speculators_config": {
                "algorithm": "eagle3",
                "proposal_methods": [
                    {
                        "proposal_type": "greedy",
                        "speculative_tokens": int(num_speculative_tokens),
                        "verifier_accept_k": 1,
                        "accept_tolerance": 0.0,
                    }
                ],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": str(verifier_info["name"]), "architectures": [arch]},
            },
            "torch_dtype": llama["torch_dtype"],
            "dtype": llama["dtype"],
            CONFIG_BLOCK: block,
        }
    meta = {
        "format_version": 1,
        "engine": engine,
        "aux_layers_hf": aux,
        "engine_layer_ids": ids,
        "layer_id_convention": block["layer_id_convention"],
        "verifier": {
            **{
                f: verifier_info[f] for f in VERIFIER_FIELDS
            },  # + the weights' fingerprint 02 recorded
            **({"weights": verifier_info["weights"]} if verifier_info.get("weights") else {}),
        },
        "drafter_args": a.to_json(),
        "include_embeddings": bool(include_embeddings),
        "variant": a.variant,
        "dtype": llama["torch_dtype"],
        "weights": WEIGHTS_FILE,
    }
    if ttt_length is not None:
        meta["ttt_length"] = int(ttt_length)
    if provenance is not None:
        meta["trained_from"] = dict(provenance)

    return _write_export_folder(Path(out_dir), engine, tensors, config, meta, provenance)


EXPORT_LOCK_SUFFIX = (
    ".lock"  # ``.{export folder name}.lock`` beside the export folder while an export writes it
)


def export_lock_path(out: Path) -> Path:
    """The lock file of the export folder ``out``: ``{out.parent}/.{out.name}.lock``. Beside the folder, not in it: the
    folder itself is renamed away and replaced, so a lock file inside it would not be one file for two writers."""
    return out.parent / f".{out.name}{EXPORT_LOCK_SUFFIX}"


def _write_export_folder(
    out: Path, engine: str, tensors: dict, config: dict, meta: dict, provenance: Optional[dict]
) -> Path:
    """:func:`export_drafter`'s write: the files into a temporary folder beside ``out``, then renamed over it, holding
    :func:`export_lock_path` (:func:`eagle3.io.exclusive_lock`) from the replace check to the rename. Two exports into
    one folder (two ``04 --export-only`` of different train folders, or one beside a finishing training) raced on
    the final rename (trial 2026-12-05g); the second one now stops at once with one line, the first one's export whole.

    Raises:
        UserError: ``<lock>: another 04_train run is exporting to <out>; ...``; :func:`_check_replaceable`'s refusals;
            disk full (the temporary folder removed, ``out`` untouched).
    """
    from safetensors.torch import save_file  # at call time: tests replace it to fill the disk

    make_dirs(out.parent)
    holder = (
        f"another 04_train run is exporting to {out}; wait for it to end, or set export.output_dir for a "
        f"second export folder"
    )
    with exclusive_lock(export_lock_path(out), holder):
        _check_replaceable(out, engine)
        _warn_other_run(out, provenance)
        tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
        os.chmod(
            tmp, file_mode(directory=True)
        )  # mkdtemp's 0o700 -> readable by a server running as another user
        try:
            with disk_full_guard(
                out / WEIGHTS_FILE, sum(t.numel() * t.element_size() for t in tensors.values())
            ):
                save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
            os.chmod(tmp / WEIGHTS_FILE, file_mode())  # safetensors writes 0o600 whatever the umask
            atomic_write_json(tmp / "config.json", config)
            atomic_write_json(tmp / META_FILE, meta)
            old = None
            if out.exists():
                old = out.parent / f"{out.name}.old-{os.getpid()}"
                os.replace(out, old)
            os.replace(tmp, out)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return out


def _warn_other_run(out: Path, provenance: Optional[dict]) -> None:
    """Log a warning when ``out`` holds an export recorded from another training folder than ``provenance``'s: a
    second run's default export folder is the first run's (``{output_root}/drafter-{engine}``), and replacing it is
    kept (re-exporting is on purpose), but not silently. Nothing is said when either side records no ``train_dir``."""
    meta_path = out / META_FILE
    if provenance is None or not provenance.get("train_dir") or not meta_path.is_file():
        return
    try:
        old = json.loads(meta_path.read_text()).get("trained_from") or {}
    except (OSError, ValueError, AttributeError):
        return
    if old.get("train_dir") and old["train_dir"] != provenance["train_dir"]:
        log.warning(
            "%s: replacing the export of another training run (%s, step %s) with this one's (%s, step %s); "
            "set export.output_dir to keep both",
            out,
            old["train_dir"],
            old.get("selected_step", "?"),
            provenance["train_dir"],
            provenance.get("selected_step", "?"),
        )


def check_export_destination(out: Path, engine: str, field: str = "export.output_dir") -> None:
    """04's start-up check of where the export will go (``04_train.py`` calls it before training): the refusals of
    :func:`_check_replaceable`, and a path under a file (it said ``<file>: File exists``). They came only after the
    whole training, with no export and no report (fresh-user trial 2026-12-05d); the checkpoints stayed, for
    ``--export-only``.

    ``field``: the config field that puts ``out`` there (``RunConfig.output_field("export")``), for the messages.

    Raises:
        UserError: as :func:`_check_replaceable`; a parent of ``out`` that is a file; or a folder above ``out`` that
            cannot be made (:func:`eagle3.io.probe_dirs`: ``<field>: cannot create the output folder ...``).
    """
    out = Path(out)
    for parent in out.parents:
        if parent.exists():
            if not parent.is_dir():
                raise UserError(f"{out}: {field} is under {parent}, which is a file, not a folder")
            break
    probe_dirs(out.parent, field)  # the export is made beside it and renamed
    _check_replaceable(out, engine)


def _check_replaceable(out: Path, engine: str) -> None:
    """Refuse to replace a folder that is not an export of this project for the same engine.

    An export replaces ``out`` whole; pointing ``export.output_dir`` at the other engine's folder
    (whose layer ids follow another convention: SGLang's are HF index - 1 for Llama) or at a folder
    of unrelated files would silently destroy it.

    Raises:
        UserError: ``out`` is a file; a non-empty folder without ``eagle3_train.json``; or an export
            for the other engine.
    """
    if not out.exists():
        return
    if not out.is_dir():
        raise UserError(f"{out}: export.output_dir is a file, not a folder")
    meta_path = out / META_FILE
    if not meta_path.is_file():
        if any(out.iterdir()):
            raise UserError(
                f"{out}: export.output_dir holds files that are not an eagle3-train export; "
                "choose an empty or new folder"
            )
        return
    try:
        old_engine = json.loads(meta_path.read_text()).get("engine")
    except (OSError, ValueError, AttributeError):
        old_engine = None
    if old_engine is not None and old_engine != engine:
        raise UserError(
            f"{out}: holds the {old_engine} export; exporting for {engine} there would replace it "
            f"(set export.output_dir to another folder, e.g. drafter-{engine})"
        )


def _read_config_json(root: Path) -> tuple[Path, dict]:
    """``(path, dict)`` of an exported folder's ``config.json``.

    Raises:
        UserError: missing or unreadable file (:func:`eagle3.io.read_json`), or not a JSON object.
    """
    cfg_path = root / "config.json"
    cfg = read_json(cfg_path)
    if not isinstance(cfg, dict):
        raise UserError(f"{cfg_path}: expected a JSON object")
    return cfg_path, cfg


def _need(cfg: dict, key: str, where: Path):
    if key not in cfg or cfg[key] is None:
        raise UserError(f"{where}: missing config key '{key}'")
    return cfg[key]


def _args_from_config(cfg: dict, path: Path) -> tuple[str, DrafterArgs]:
    """Detect the format and build :class:`DrafterArgs` from a ``config.json`` dict."""
    archs = cfg.get("architectures") or []
    if cfg.get("speculators_model_type") == "eagle3" or VLLM_ARCH in archs:
        engine = "vllm"
        layer = _need(cfg, "transformer_layer_config", path)
        if cfg.get("norm_before_residual", True):
            raise UserError(
                f"{path}: key 'norm_before_residual' must be false for this drafter (hidden_norm before the residual is not implemented)"
            )
        src = dict(layer)
        src["draft_vocab_size"] = _need(cfg, "draft_vocab_size", path)
        src["target_hidden_size"] = cfg.get("target_hidden_size") or layer.get("hidden_size")
    elif SGLANG_ARCH in archs:
        engine = "sglang"
        src = dict(cfg)
        src["target_hidden_size"] = cfg.get("target_hidden_size") or cfg.get("hidden_size")
    else:
        raise UserError(
            f"{path}: key 'architectures' is {archs}; expected [{SGLANG_ARCH!r}] or [{VLLM_ARCH!r}]"
        )
    variant = _config_variant(cfg, path)
    n_layers = src.get("num_hidden_layers", 1)
    if not isinstance(n_layers, int) or isinstance(n_layers, bool) or n_layers < 1:
        raise UserError(
            f"{path}: key 'num_hidden_layers' must be an integer >= 1 (the drafter's decoder layers), "
            f"got {n_layers!r}"
        )
    heads = _need(src, "num_attention_heads", path)
    H = _need(src, "hidden_size", path)
    args = DrafterArgs(
        hidden_size=H,
        num_attention_heads=heads,
        num_key_value_heads=src.get("num_key_value_heads") or heads,
        head_dim=src.get("head_dim") or H // heads,
        intermediate_size=_need(src, "intermediate_size", path),
        rms_norm_eps=_need(src, "rms_norm_eps", path),
        rope_theta=src.get("rope_theta")
        or (src.get("rope_parameters") or {}).get("rope_theta", 10000.0),
        max_position_embeddings=src.get("max_position_embeddings", 2048),
        draft_vocab_size=_need(src, "draft_vocab_size", path),
        target_vocab_size=_need(src, "vocab_size", path),
        target_hidden_size=src["target_hidden_size"],
        rope_scaling=src.get("rope_scaling"),
        variant=variant,
        num_layers=n_layers,
    )
    return engine, args


def _config_variant(cfg: dict, path: Path) -> str:
    """The drafter variant a ``config.json`` makes the engines build (the keys SGLang 0.5.23 / vLLM 0.33 read).

    ``fc_norm`` (or SGLang's legacy ``use_aux_norm``) and ``norm_output`` both true = ``eagle3.1``, both
    false/absent = ``eagle3``.

    Raises:
        UserError: ``norm_before_fc`` (one norm over the concatenated aux states, not implemented here) or
            only one of the two EAGLE-3.1 keys set (neither variant), naming the file and key.
    """
    ec = cfg.get("eagle_config") if isinstance(cfg.get("eagle_config"), dict) else {}
    if cfg.get("norm_before_fc") or ec.get("norm_before_fc"):
        raise UserError(
            f"{path}: key 'norm_before_fc' is true (one RMSNorm over the concatenated aux states); this "
            f"project implements eagle3 and eagle3.1 (fc_norm: one norm per aux state) only"
        )
    fc_norm = bool(cfg.get("fc_norm") or cfg.get("use_aux_norm"))
    norm_output = bool(cfg.get("norm_output"))
    if fc_norm != norm_output:
        raise UserError(
            f"{path}: keys 'fc_norm' ({fc_norm}) and 'norm_output' ({norm_output}) differ; eagle3 has both "
            f"false, eagle3.1 both true, and this project implements only those two"
        )
    return "eagle3.1" if fc_norm else "eagle3"


def _config_layer_ids(cfg: dict, engine: str, path: Path) -> Optional[list[int]]:
    """The aux-layer ids the engine reads from ``config.json`` (``None`` when not stated)."""
    if engine == "sglang":
        ec = cfg.get("eagle_config") or {}
        ids = ec.get("eagle_aux_hidden_state_layer_ids") if isinstance(ec, dict) else None
        key = "eagle_config.eagle_aux_hidden_state_layer_ids"
    else:
        ids, key = cfg.get("eagle_aux_hidden_state_layer_ids"), "eagle_aux_hidden_state_layer_ids"
    if ids is None:
        return None
    if not isinstance(ids, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in ids
    ):
        raise UserError(f"{path}: key '{key}' must be a list of integers, got {ids!r}")
    return list(ids)


def reexport_hint(root: Path, engine: str) -> str:
    """How to get the ``engine`` export of the run that exported ``root`` (the text after ``Use the <engine> export: ``
    in :func:`check_export_folder`'s refusal). ``04_train.py --export-only --engine <engine>`` was advised also where
    it cannot work: it reads the run's checkpoints, which the host serving or benchmarking the folder may not have. The
    folder's ``eagle3_train.json`` ``trained_from.train_dir`` says where they were: an export of that run for
    ``engine`` beside ``root`` is named first; else ``--export-only`` when that folder holds checkpoints here; else
    that it needs them (run it where they are)."""
    from eagle3.train.checkpoint import ckpt_dir, list_checkpoints

    cmd = f"04_train.py --export-only --engine {engine}"
    try:
        src = (read_json(root / META_FILE).get("trained_from") or {}).get("train_dir")
    except (UserError, AttributeError, OSError):
        src = None
    sib = root.parent / f"drafter-{engine}"
    if src and sib != root and (sib / "config.json").is_file():
        try:
            sib_src = (read_json(sib / META_FILE).get("trained_from") or {}).get("train_dir")
        except (UserError, AttributeError, OSError):
            sib_src = None
        if sib_src == src:
            return f"{sib} (the same run's, beside this one)"
    if not src:
        return cmd
    if list_checkpoints(src):
        return f"{cmd} writes it from {ckpt_dir(src)} (with the run's config)"
    return (
        f"{cmd} needs the run's checkpoints, and {ckpt_dir(src)} (trained_from in {root / META_FILE}) holds none on "
        f"this machine: run it where they are"
    )


def _recorded_block(cfg: dict, root: Path) -> Optional[dict]:
    """Our ``eagle3_train`` block of ``config.json``, else the same facts from ``eagle3_train.json``."""
    block = cfg.get(CONFIG_BLOCK)
    src = root / "config.json"
    if block is None and (root / META_FILE).is_file():
        meta = read_json(root / META_FILE)
        if isinstance(meta, dict) and "engine" in meta and "aux_layers_hf" in meta:
            block = {
                "engine": meta["engine"],
                "aux_layers_hf": meta["aux_layers_hf"],
                "verifier_architecture": (meta.get("verifier") or {}).get("architecture"),
            }
            src = root / META_FILE
    if block is None:
        return None
    if not isinstance(block, dict):
        raise UserError(f"{src}: key '{CONFIG_BLOCK}' must be an object")
    aux = block.get("aux_layers_hf")
    if not isinstance(aux, list) or len(aux) != 3 or not all(isinstance(i, int) for i in aux):
        raise UserError(f"{src}: key 'aux_layers_hf' must be a list of 3 integers, got {aux!r}")
    if block.get("engine") not in ("sglang", "vllm"):
        raise UserError(
            f"{src}: key 'engine' must be 'sglang' or 'vllm', got {block.get('engine')!r}"
        )
    return dict(block, source=str(src))


def check_export_folder(
    path: str | os.PathLike,
    serving_engine: Optional[str] = None,
    shards_aux_hf: Optional[list[int]] = None,
    verifier_architecture: Optional[str] = None,
) -> dict:
    """Which engine an exported folder is for, which verifier layers it makes that engine capture,
    and whether that agrees with its metadata, the intended engine and the shards.

    The engine is read from ``config.json`` (``architectures``); the ids it states are converted
    to HF indices with that engine's rule (:func:`eagle3.layers.hf_layers_from_engine`; verifier
    architecture from the ``eagle3_train`` block or ``verifier_architecture``).

    Args:
        path: exported folder.
        serving_engine: ``sglang``/``vllm`` when the caller knows which engine serves the folder
            (e.g. the SGLang server benchmark); ``None`` for engine-neutral loaders.
        shards_aux_hf: the HF aux layers of the training shards (``data_config.json``).
        verifier_architecture: used when the folder records none (third-party exports).

    Returns:
        ``{"engine", "engine_layer_ids" (or None), "aux_layers_hf" (HF indices the engine
        captures, or None when unknown), "warnings": [str]}``.

    Raises:
        UserError: ``config.json`` unreadable or of neither format; the recorded engine differs
            from the folder's format; the stated ids are not the engine's ids for the recorded
            HF layers (edited by hand or copied from the other engine's folder); or the folder
            is for another engine than ``serving_engine``.
    """
    root = Path(path)
    cfg_path, cfg = _read_config_json(root)
    engine, _args = _args_from_config(cfg, cfg_path)
    ids = _config_layer_ids(cfg, engine, cfg_path)
    block = _recorded_block(cfg, root)
    warnings: list[str] = []
    other = "vllm" if engine == "sglang" else "sglang"
    if serving_engine is not None and serving_engine != engine:
        raise UserError(
            f"{cfg_path}: this folder is for {engine}, but {serving_engine} serves it; {serving_engine} reads "
            f"its layer ids {ids} in another convention (one layer off for Llama verifiers). Use the "
            f"{serving_engine} export: {reexport_hint(root, serving_engine)}"
        )
    aux_hf = None
    arch = (block or {}).get("verifier_architecture") or verifier_architecture
    if block is not None:
        if block["engine"] != engine:
            raise UserError(
                f"{block['source']}: key 'engine' is {block['engine']!r} but {cfg_path} is in the {engine} "
                f"format; the folder mixes two exports (re-export with --engine {block['engine']})"
            )
        aux_hf = [int(i) for i in block["aux_layers_hf"]]
        if arch is not None:
            want = engine_layer_ids(aux_hf, engine, str(arch))
            if ids != want:
                raise UserError(
                    f"{cfg_path}: layer ids {ids} are not {engine}'s ids for the recorded HF aux layers "
                    f"{aux_hf} (expected {want}: {layer_id_convention(engine, str(arch))}); edited by hand "
                    f"or copied from the {other} folder? Re-export with --engine {engine}"
                )
    elif ids is not None and arch is not None:
        aux_hf = hf_layers_from_engine(ids, engine, str(arch))
    elif ids is None:
        warnings.append(
            f"{cfg_path}: states no aux layer ids; {engine} will use its default layers"
        )
    else:
        warnings.append(
            f"{cfg_path}: no '{CONFIG_BLOCK}' block and no verifier architecture: cannot tell which "
            f"verifier layers the {engine} ids {ids} select"
        )
    if (
        shards_aux_hf is not None
        and aux_hf is not None
        and list(aux_hf) != [int(i) for i in shards_aux_hf]
    ):
        warnings.append(
            f"{cfg_path}: {engine} will capture HF layers {aux_hf} (ids {ids}) but the shards were "
            f"extracted at HF layers {list(shards_aux_hf)}: expect near-zero acceptance"
        )
    return {
        "engine": engine,
        "engine_layer_ids": ids,
        "aux_layers_hf": aux_hf,
        "warnings": warnings,
    }


def preflight_export(path: str | os.PathLike) -> tuple[Path, str, DrafterArgs, Path, list[str]]:
    """The cheap checks of an exported folder, without reading its tensors: ``config.json`` (keys, engine),
    the folder's layer ids (:func:`check_export_folder`: its warnings are returned, not logged) and the weights file's safetensors header
    against its size (a truncated or half-written file fails here). Stage 05 runs it before loading the verifier,
    which takes minutes at Kimi scale, so a bad ``--drafter`` fails at once.

    Returns:
        ``(config.json path, engine, DrafterArgs, weights path, warnings)``.

    Raises:
        UserError: as :func:`load_exported` for ``config.json``; the weights file missing, or not a readable
            safetensors file (naming it).
    """
    from safetensors import SafetensorError, safe_open

    root = Path(path)
    cfg_path, cfg = _read_config_json(root)
    engine, args = _args_from_config(cfg, cfg_path)
    warnings = check_export_folder(root)["warnings"]
    wpath = root / WEIGHTS_FILE
    if not wpath.is_file():
        raise UserError(f"{wpath}: file not found")
    try:
        with safe_open(str(wpath), framework="pt") as f:
            f.keys()
    except (SafetensorError, OSError, ValueError) as e:
        raise UserError(
            f"{wpath}: unreadable safetensors file: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
        ) from e
    return cfg_path, engine, args, wpath, warnings


def load_exported(
    path: str | os.PathLike, embed_weight: Optional[torch.Tensor] = None
) -> Eagle3Drafter:
    """Load an exported folder (either format) into an :class:`Eagle3Drafter` (float32, CPU).

    Weights stored in bfloat16/float16 are upcast exactly, so ``load_exported(...).to(bf16)``
    computes what the exported drafter cast to bf16 computes.

    Args:
        path: folder written by :func:`export_drafter` (or a compatible SGLang/SpecForge/speculators one).
        embed_weight: the verifier's input embedding ``[target_V, H]``; required when the folder has
            no ``embed_tokens.weight``.

    A folder without ``d2t``/``t2d`` is accepted when ``draft_vocab_size`` equals ``vocab_size``
    (identity map; vLLM's full-vocab format); a vLLM folder WITH ``d2t`` in that case is refused,
    as vLLM refuses it (:func:`writes_vocab_map`).

    Raises:
        UserError: missing/bad ``config.json`` key, a folder whose layer ids disagree with its
            recorded engine/HF layers (:func:`check_export_folder`), missing or unexpected tensor,
            wrong tensor shape, an invalid ``d2t``/``t2d`` (:func:`eagle3.data.vocab.check_vocab_map`),
            or no embeddings available -- each naming the file and key.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    cfg_path, engine, args, wpath, warnings = preflight_export(path)
    for w in warnings:
        log.warning("%s", w)
    try:
        tensors = load_file(str(wpath))
    except (SafetensorError, OSError, ValueError) as e:
        raise UserError(
            f"{wpath}: unreadable safetensors file: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
        ) from e
    if engine == "vllm":
        tensors = {
            (k.replace("layers.0.", "midlayer.", 1) if k.startswith("layers.0.") else k): v
            for k, v in tensors.items()
        }
    full_vocab = args.draft_vocab_size == args.target_vocab_size
    if engine == "vllm" and full_vocab and "d2t" in tensors:
        raise UserError(
            f"{wpath}: tensor 'd2t' in a full-vocab folder ({cfg_path.name} draft_vocab_size = vocab_size = "
            f"{args.draft_vocab_size}): vLLM refuses it (Eagle3LlamaForCausalLM has no "
            f"'draft_id_to_target_id' when the draft vocab is the verifier's); re-export with 04_train.py "
            f"--export-only --engine vllm"
        )
    if full_vocab and "d2t" not in tensors and "t2d" not in tensors:
        tensors["d2t"] = torch.zeros(
            args.draft_vocab_size, dtype=torch.int64
        )  # identity map, as both engines use it
        tensors["t2d"] = torch.ones(args.target_vocab_size, dtype=torch.bool)
    want = required_keys("sglang", args.variant, args.num_layers)
    for key in want:
        if key not in tensors:
            shown = key.replace("midlayer.", "layers.0.", 1) if engine == "vllm" else key
            why = (
                f" (draft_vocab_size {args.draft_vocab_size} < vocab_size {args.target_vocab_size}: without it the "
                f"engine takes every draft id for the target id of the same number)"
                if key == "d2t"
                else ""
            )
            raise UserError(f"{wpath}: missing required tensor '{shown}'{why}")
    extra = sorted(set(tensors) - set(want) - {EMBED_KEY})
    if extra:
        raise UserError(f"{wpath}: unexpected tensor '{extra[0]}'")
    for i in range(
        1, args.num_layers
    ):  # the pre-attention norm of layer i: the one this folder's engine applies
        pre = f"layers.{i}."
        used, other = (
            pre + ENGINE_UPPER_NORM[engine],
            pre + [k for k in UPPER_NORM_KEYS if k != ENGINE_UPPER_NORM[engine]][0],
        )
        if not torch.equal(tensors[used], tensors[other]):
            log.warning(
                "%s: '%s' differs from '%s'; %s applies '%s' (loaded), the other engine the other one",
                wpath,
                used,
                other,
                engine,
                used,
            )
        weight = tensors.pop(used)
        tensors.pop(other)
        tensors[pre + "input_layernorm.weight"] = weight  # the drafter's name (Eagle3UpperLayer)
    drafter = Eagle3Drafter(args)
    sd = drafter.state_dict()
    for k, v in tensors.items():
        if tuple(v.shape) != tuple(sd[k].shape):
            raise UserError(
                f"{wpath}: tensor '{k}' has shape {list(v.shape)}, config implies {list(sd[k].shape)}"
            )
    if EMBED_KEY not in tensors:
        if embed_weight is None:
            raise UserError(
                f"{wpath}: no '{EMBED_KEY}' stored; pass the verifier's embedding (embed_weight)"
            )
        if tuple(embed_weight.shape) != tuple(sd[EMBED_KEY].shape):
            hint = (
                f" (the drafter's hidden_size {args.hidden_size} differs from target_hidden_size "
                f"{args.target_hidden_size}: the folder must carry its own '{EMBED_KEY}')"
                if args.hidden_size != args.target_hidden_size
                else ""
            )
            raise UserError(
                f"embed_weight has shape {list(embed_weight.shape)}, {cfg_path} implies "
                f"{list(sd[EMBED_KEY].shape)}{hint}"
            )
        tensors[EMBED_KEY] = embed_weight
    check_vocab_map(
        tensors["d2t"],
        tensors["t2d"],
        str(wpath),
        target_vocab_size=args.target_vocab_size,
        draft_vocab_size=args.draft_vocab_size,
        draft_key=f"{cfg_path.name} draft_vocab_size",
        target_source=f"{cfg_path.name} vocab_size",
    )
    with torch.no_grad():
        for k, v in tensors.items():
            sd[k].copy_(v.to(sd[k].dtype) if v.is_floating_point() else v)
    return drafter


def read_export_meta(path: str | os.PathLike) -> dict:
    """Our metadata ``eagle3_train.json`` of an exported folder (aux layers, engine ids, verifier).

    Raises:
        UserError: file missing or malformed.
    """
    return read_json(Path(path) / META_FILE)
