"""Greedy decoding of token-id prompts by vLLM's offline engine, with or without an EAGLE-3 draft; run in .venv-vllm
(scripts/setup_vllm.sh), never in the project's venv, and imports nothing of the project.

Writes one JSON: ``{"vllm": version, "method", "draft", "steps", "aux_layers": the layers the verifier captured
(HF hidden_states indices; null without a draft), "prompts": [{"id", "tokens", "drafts", "draft_tokens",
"accepted", "accepted_per_pos"}]}``: the counters are vLLM's own spec-decode counters (``vllm:spec_decode_*``),
read before and after each prompt, which is decoded alone (batch 1) so that each prompt's counts are its own.
Usage (scripts/serve_gate.py runs it): python scripts/vllm_probe.py --model DIR [--draft DIR --steps K
[--draft-attention-backend NAME]]
--prompts FILE.json --max-tokens N --stop-ids I [I ...] --out FILE.json
"""

from __future__ import annotations

import argparse
import json
import os

# in-process engine core: apply_model reaches the model without pickling a function across processes
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

COUNTERS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted",
}
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def read_counters(llm, steps: int) -> dict:
    """The spec-decode counters of ``llm`` now (zeros before the first draft): drafts, draft_tokens, accepted
    (ints) and accepted_per_pos (``steps`` ints)."""
    out = {v: 0 for v in COUNTERS.values()}
    out["accepted_per_pos"] = [0] * steps
    for m in llm.get_metrics():
        if m.name in COUNTERS:
            out[COUNTERS[m.name]] += int(m.value)
        elif m.name == PER_POS:
            out["accepted_per_pos"] = [
                a + int(b) for a, b in zip(out["accepted_per_pos"], m.values)
            ]
    return out


def captured_layers(model) -> list[int]:
    """The verifier's aux layers as vLLM set them (``EagleModelMixin.aux_hidden_state_layers``)."""
    holder = model.get_language_model() if hasattr(model, "get_language_model") else model
    holder = getattr(holder, "model", holder)
    return [int(i) for i in getattr(holder, "aux_hidden_state_layers", ())]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft")
    ap.add_argument("--method", default="eagle3")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--max-tokens", type=int, required=True)
    ap.add_argument("--stop-ids", type=int, nargs="+", required=True)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument(
        "--draft-attention-backend",
        help="the draft's attention backend (CPU_MLA: an fp32 MLA draft)",
    )
    ap.add_argument("--out", required=True)
    a = ap.parse_args()

    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = None
    if a.draft:
        spec = {"method": a.method, "model": a.draft, "num_speculative_tokens": a.steps}
        if a.draft_attention_backend:
            spec["attention_backend"] = a.draft_attention_backend
    llm = LLM(
        model=a.model,
        dtype="float32",
        max_model_len=a.max_model_len,
        max_num_seqs=1,
        enforce_eager=True,
        seed=0,
        disable_log_stats=False,
        speculative_config=spec,
    )
    aux = llm.apply_model(captured_layers)[0] if a.draft else None
    params = SamplingParams(
        temperature=0.0, max_tokens=a.max_tokens, stop_token_ids=a.stop_ids, detokenize=False
    )
    with open(a.prompts) as f:
        prompts = json.load(f)
    rows = []
    for p in prompts:
        before = read_counters(llm, a.steps)
        (res,) = llm.generate(
            [TokensPrompt(prompt_token_ids=p["token_ids"])], params, use_tqdm=False
        )
        after = read_counters(llm, a.steps)
        row = {"id": p["id"], "tokens": list(res.outputs[0].token_ids)}
        for k in COUNTERS.values():
            row[k] = after[k] - before[k]
        row["accepted_per_pos"] = [
            x - y for x, y in zip(after["accepted_per_pos"], before["accepted_per_pos"])
        ]
        rows.append(row)
    report = {
        "vllm": vllm.__version__,
        "method": a.method if a.draft else None,
        "draft": a.draft,
        "steps": a.steps if a.draft else 0,
        "aux_layers": aux,
        "prompts": rows,
    }
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
