"""How predictable the verifier's own greedy answers are, per prompt set: the ceiling a drafter works under.

Under greedy verification a draft token is accepted when it equals the verifier's argmax. Where the verifier itself
is unsure (its top-1 probability low, its top-2 close), the argmax hangs on fine detail of the context and a drafter
misses it more often whatever data it was trained on. So when a drafter accepts less on one prompt set than on
another, this script says whether the verifier's answers there are less predictable to begin with.

For each prompt (05's sets: ``mtbench``, ``humaneval``, ``gsm8k`` or a messages JSONL, rendered as 05 renders them)
the verifier decodes greedily with 05's own batched greedy decoder (up to ``--max-new-tokens``, stopping at 05's
end-of-turn ids); one plain forward over prompt + answer then gives, for every answer token, the softmax probability of its argmax (``p1``) and the
log-probability margin to the runner-up (``logp1 - logp2``). Per set, token-weighted: mean ``p1``, the share of tokens
with ``p1 < 0.5`` and with margin < 1 nat (near-ties a drafter must break like the verifier), and mean entropy
(nats). Batches of ``--batch-size`` prompts; float32 on CPU.

    python bench/verifier_confidence.py --config configs/smollm2-135m-127k.yaml --set verifier.device=cpu \\
        --set verifier.dtype=float32 --num-prompts 40 --datasets chat_unseen.jsonl mtbench --out confidence.json
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from eagle3.chat.template import ChatOptions, end_of_turn_ids, prompt_ids  # noqa: E402
from eagle3.cli import ArgumentParser, run_main  # noqa: E402
from eagle3.config import load_config  # noqa: E402
from eagle3.data.eval_prompts import (  # noqa: E402
    check_dataset_names,
    dataset_label,
    load_eval_prompts,
    pick_prompts,
    too_few_note,
)
from eagle3.io import write_json_and_markdown  # noqa: E402

log = logging.getLogger(__name__)


def step_confidence(scores: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-row confidence of one decoding step's logits.

    Args:
        scores: float ``[B, V]`` logits of the next token.

    Returns:
        ``{"p1", "margin", "entropy"}``, each float32 ``[B]``: the argmax's softmax probability, ``logp1 - logp2`` (nats)
        and the entropy (nats) of the softmax.
    """
    logp = torch.log_softmax(scores.float(), dim=-1)  # [B, V]
    top2 = logp.topk(2, dim=-1).values  # [B, 2]
    return {
        "p1": top2[:, 0].exp(),
        "margin": top2[:, 0] - top2[:, 1],
        "entropy": -(logp.exp() * logp).sum(-1),
    }


@torch.no_grad()
def greedy_confidence(
    model, batch: Sequence[list[int]], max_new_tokens: int, eos: set[int]
) -> list[dict]:
    """Greedy answers of one batch (05's own batched greedy decoder) and the confidence of every answer token.

    The answers come from :func:`eagle3.decoding.decode.greedy_generate_batch` (what 05's baseline emits); then one
    plain forward over prompt + answer per row gives the logits that chose each answer token (position
    ``len(prompt) - 1 + j`` chose answer token ``j``).

    Args:
        model: a transformers causal LM (the verifier, eval mode).
        batch: prompt token ids, one list per row.
        max_new_tokens: answer budget per row.
        eos: end-of-turn ids; a row's answer ends at (and includes) the first one.

    Returns:
        One ``{"tokens", "p1", "margin", "entropy", "argmax_differs"}`` per row, in order; ``argmax_differs`` counts
        answer tokens that the full forward's argmax would not have chosen (a near-tie decided differently by the
        KV-cached decode: 0 or a handful in float32).
    """
    from eagle3.decoding.decode import greedy_generate_batch

    dev = next(model.parameters()).device
    answers = greedy_generate_batch(model, batch, max_new_tokens, sorted(eos)).tokens
    rows = []
    for prompt, ans in zip(batch, answers):
        seq = torch.tensor([list(prompt) + list(ans)], dtype=torch.long, device=dev)  # [1, P + A]
        logits = model(input_ids=seq).logits[
            0, len(prompt) - 1 : seq.shape[1] - 1
        ]  # [A, V]: row j chose answer j
        conf = step_confidence(logits)
        rows.append(
            {
                "tokens": list(ans),
                **{k: v.tolist() for k, v in conf.items()},
                "argmax_differs": int((logits.argmax(-1).cpu() != torch.tensor(ans)).sum()),
            }
        )
    return rows


def summarize(rows: list[dict]) -> dict:
    """Token-weighted figures of one set's rows (:func:`greedy_confidence`)."""
    p1 = [x for r in rows for x in r["p1"]]
    margin = [x for r in rows for x in r["margin"]]
    ent = [x for r in rows for x in r["entropy"]]
    n = len(p1)
    return {
        "prompts": len(rows),
        "answer_tokens": n,
        "argmax_differs": sum(r["argmax_differs"] for r in rows),
        "mean_p1": round(sum(p1) / n, 4) if n else None,
        "share_p1_below_0.5": round(sum(x < 0.5 for x in p1) / n, 4) if n else None,
        "share_margin_below_1nat": round(sum(x < 1.0 for x in margin) / n, 4) if n else None,
        "mean_entropy_nats": round(sum(ent) / n, 4) if n else None,
    }


def markdown(report: dict) -> str:
    """One row per set."""
    lines = [
        "| set | prompts | answer tokens | mean p1 | p1 < 0.5 | margin < 1 nat | entropy (nats) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, s in report["sets"].items():
        lines.append(
            f"| {name} | {s['prompts']} | {s['answer_tokens']} | {s['mean_p1']:.3f} | "
            f"{s['share_p1_below_0.5']:.3f} | {s['share_margin_below_1nat']:.3f} | {s['mean_entropy_nats']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True)
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument(
        "--datasets",
        nargs="+",
        required=True,
        help="mtbench, humaneval, gsm8k or messages JSONL files",
    )
    p.add_argument(
        "--num-prompts", type=int, default=None, help="first N prompts of each set (default: all)"
    )
    p.add_argument(
        "--max-new-tokens", type=int, default=None, help="default: benchmark.max_new_tokens"
    )
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument(
        "--out", type=Path, required=True, help="JSON path; the Markdown table goes beside it (.md)"
    )
    a = p.parse_args(argv)
    cfg = load_config(a.config, a.set)
    check_dataset_names(a.datasets, "--datasets", indexed=False)  # before the verifier loads
    from eagle3.verifier.load import load_verifier, resolve_device

    model, tok = load_verifier(cfg.verifier, resolve_device(cfg.verifier.device))
    model.eval()
    eos = end_of_turn_ids(tok)
    chat = ChatOptions.from_verifier(cfg.verifier, cfg.extract.loss_on_reasoning)
    max_new = a.max_new_tokens or cfg.benchmark.max_new_tokens
    report = {
        "config": a.config,
        "overrides": a.set,
        "max_new_tokens": max_new,
        "dtype": str(model.dtype),
        "device": str(next(model.parameters()).device),
        "sets": {},
    }
    for name in a.datasets:
        everything = load_eval_prompts(name)
        prompts = pick_prompts(everything, a.num_prompts)  # the first N
        short = too_few_note(
            dataset_label(name), a.num_prompts, len(everything), "--num-prompts", "measured"
        )
        if short:
            log.warning("%s", short)
        ids = [prompt_ids(tok, q.messages, chat) for q in prompts]
        rows = []
        for i in tqdm(
            range(0, len(ids), a.batch_size), desc=f"confidence {dataset_label(name)}", unit="batch"
        ):
            rows += greedy_confidence(model, ids[i : i + a.batch_size], max_new, eos)
        report["sets"][dataset_label(name)] = summarize(rows)
    md = markdown(report)
    write_json_and_markdown(a.out, report, md)
    print(md, end="")
    return 0


if __name__ == "__main__":
    run_main(main)
