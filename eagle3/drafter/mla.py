"""The MLA draft layer's sizes (``drafter.attention: mla``): where they come from, and the parameter counts that
size it against the Llama-style layer.

Sizes (:data:`eagle3.drafter.args.MLA_FIELDS`): each ``drafter.mla.*`` value that is set wins; a null one is the
verifier's when the verifier is an MLA model (:func:`eagle3.verifier.arch.mla_sizes`), else ``q_lora_rank`` null =
a plain ``q_proj``, ``rope_interleave`` null = true, and any other null is refused (a Llama verifier has no latent
sizes to copy). The layer's heads are ``drafter.num_attention_heads`` (null: the verifier's); ``num_key_value_heads``
= heads and ``head_dim`` = ``qk_nope_head_dim + qk_rope_head_dim`` follow from MLA (per-head keys after the
up-projection).

Sizing against the Llama-style layer: ``python -m eagle3.drafter.mla --hidden 576 --heads 9 --kv-heads 3
--head-dim 64 --intermediate 1536 --mla q_lora_rank=384,kv_lora_rank=128,qk_nope_head_dim=64,qk_rope_head_dim=32,
v_head_dim=64`` prints both layers' attention and decoder-layer parameter counts and their ratio
(:func:`param_counts`); ``--max-diff 0.03`` exits 1 when they differ by more.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Optional

import torch

from eagle3.drafter.args import MLA_FIELDS, DrafterArgs
from eagle3.drafter.model import Eagle3DecoderLayer
from eagle3.errors import UserError
from eagle3.verifier.arch import mla_rope_scaling, mla_sizes


def resolve_mla(given: dict, verifier_mla: Optional[dict]) -> dict:
    """The MLA sizes of the drafter: ``given`` (``drafter.mla``: field -> value or None) over ``verifier_mla``
    (:func:`eagle3.verifier.arch.mla_sizes` of the verifier's text config; None = not an MLA verifier).

    Raises:
        UserError: a size neither set nor the verifier's, naming ``drafter.mla.<key>``.
    """
    out = {}
    for k in MLA_FIELDS:
        v = given.get(k)
        if v is None and verifier_mla is not None:
            v = verifier_mla.get(k)
        if v is None and k == "rope_interleave":
            v = True
        if v is None and k not in ("q_lora_rank",):
            raise UserError(
                f"drafter.mla.{k} is null and the verifier is not an MLA model; set drafter.mla.{k} "
                f"(python -m eagle3.drafter.mla sizes it against the Llama-style layer)"
            )
        out[k] = v
    return out


def mla_shape_fields(heads: int, mla: dict) -> dict:
    """``num_key_value_heads`` and ``head_dim`` of an MLA drafter's :class:`DrafterArgs`: ``heads`` and
    ``qk_nope_head_dim + qk_rope_head_dim``."""
    return {
        "num_key_value_heads": int(heads),
        "head_dim": int(mla["qk_nope_head_dim"]) + int(mla["qk_rope_head_dim"]),
    }


def mla_drafter_fields(mla_given: dict, heads: int, tc: Any) -> dict:
    """The :class:`DrafterArgs` fields of an MLA drafter (``attention``, ``mla``, ``num_key_value_heads``,
    ``head_dim``, and ``rope_scaling`` = the verifier's when it is MLA, e.g. Kimi's YaRN) from ``drafter.mla``
    (``mla_given``), the layer's ``heads`` and the verifier's text config ``tc``.

    Raises:
        UserError: as :func:`resolve_mla`.
    """
    verifier_mla = mla_sizes(tc)
    mla = resolve_mla(mla_given, verifier_mla)
    out = {"attention": "mla", "mla": mla, **mla_shape_fields(heads, mla)}
    if verifier_mla is not None:
        out["rope_scaling"] = mla_rope_scaling(tc)
    return out


def param_counts(args: DrafterArgs) -> dict[str, int]:
    """Trainable parameters of the drafter's decoder layer 0 (``midlayer``): ``attention`` (its ``self_attn``) and
    ``layer`` (all of it: attention, MLP, three norms), counted on the meta device."""
    with torch.device("meta"):
        layer = Eagle3DecoderLayer(args)
    return {
        "attention": sum(p.numel() for p in layer.self_attn.parameters()),
        "layer": sum(p.numel() for p in layer.parameters()),
    }


def _parse_mla(text: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in filter(None, text.split(",")):
        k, _, v = item.partition("=")
        out[k.strip()] = (
            None
            if v.strip() in ("null", "none", "")
            else (v.strip() == "true" if v.strip() in ("true", "false") else int(v))
        )
    out.setdefault("rope_interleave", True)
    out.setdefault("q_lora_rank", None)
    return out


def main(argv: Optional[list[str]] = None) -> int:
    """Print the Llama-style and MLA decoder layers' parameter counts (module docstring); 1 when their attention
    counts differ by more than ``--max-diff`` (a fraction of the Llama-style count)."""
    p = argparse.ArgumentParser(
        prog="python -m eagle3.drafter.mla", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--hidden", type=int, required=True)
    p.add_argument("--heads", type=int, required=True)
    p.add_argument("--kv-heads", type=int, required=True)
    p.add_argument("--head-dim", type=int, required=True)
    p.add_argument("--intermediate", type=int, required=True)
    p.add_argument("--mla", required=True, help="key=value,... of " + ", ".join(MLA_FIELDS))
    p.add_argument(
        "--mla-heads", type=int, default=None, help="the MLA layer's heads (default --heads)"
    )
    p.add_argument("--max-diff", type=float, default=None)
    ns = p.parse_args(argv)
    common = dict(
        hidden_size=ns.hidden,
        intermediate_size=ns.intermediate,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=2048,
        draft_vocab_size=1,
        target_vocab_size=1,
        target_hidden_size=ns.hidden,
    )
    llama = DrafterArgs(
        num_attention_heads=ns.heads,
        num_key_value_heads=ns.kv_heads,
        head_dim=ns.head_dim,
        **common,
    )
    mla = _parse_mla(ns.mla)
    heads = ns.mla_heads or ns.heads
    mla_args = DrafterArgs(
        num_attention_heads=heads,
        **mla_shape_fields(heads, mla),
        **common,
        attention="mla",
        mla=mla,
    )
    a, b = param_counts(llama), param_counts(mla_args)
    diff = b["attention"] / a["attention"] - 1
    print(f"llama attention {a['attention']:,} / decoder layer {a['layer']:,}")
    print(f"mla   attention {b['attention']:,} / decoder layer {b['layer']:,}")
    print(f"mla / llama: attention {diff:+.2%}, decoder layer {b['layer'] / a['layer'] - 1:+.2%}")
    if ns.max_diff is not None and abs(diff) > ns.max_diff:
        print(
            f"attention counts differ by {abs(diff):.2%} > --max-diff {ns.max_diff:.2%}",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
