"""Prompt sets that tell memorisation from distribution shift: seen / held-out / unseen first turns of one run.

A drafter that scores well on held-out training data and worse on a benchmark has either learnt its training
conversations (memorisation: it needs more distinct data) or meets prompts unlike them (distribution shift: it
needs other data). 05 on three prompt sets drawn from the same source tells which, with the real acceptance
measure rather than teacher-forced top-1:

- ``seen``: first user turns of conversations the run trained on (in 03's training split);
- ``heldout``: first user turns of its validation split (03's seeded split: few when ``data.val_fraction`` is small);
- ``unseen``: first user turns of the config's ``prompts.source`` conversations the run never drew (01's
  ``prompts.sample_size`` left them out; matched by 01's dedupe key, the normalised first user message).

Only conversations whose id matches ``--id-pattern`` (default: ShareGPT's ids such as ``03iMgaN_89``, the chat
prompts of ``../shared/data/train``) and whose first user turn is at most ``--max-chars`` long are drawn; each set is
``-n`` prompts drawn with ``random.Random(--seed)`` (all when fewer). The split is recomputed with 03's own
:func:`eagle3.data.split.split_indices` over 02's ``manifest.jsonl`` sample ids, with the config's
``data.val_fraction`` and ``data.seed``, so it is the run's split. Output: ``chat_{seen,heldout,unseen}.jsonl``
(messages JSONL, one user turn each: 05 takes them as ``--datasets``) and ``fit_sets.json`` (counts, settings).

    python bench/fit_prompt_sets.py --config configs/smollm2-135m-127k.yaml --set prompts.sample_size=100000 \\
        --prompts outputs/diag/prompts.jsonl --manifest outputs/diag/shards/manifest.jsonl --out outputs/diag/evalsets
    python 05_benchmark.py --config configs/smollm2-135m-127k.yaml --set verifier.device=cpu \\
        --set verifier.dtype=float32 --drafter DRAFTER --num-prompts 40 --steps 3 --batch-size 20 \\
        --datasets outputs/diag/evalsets/chat_seen.jsonl outputs/diag/evalsets/chat_unseen.jsonl mtbench
"""

from __future__ import annotations

import json
import logging
import random
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle3.cli import ArgumentParser, run_main  # noqa: E402
from eagle3.config import load_config  # noqa: E402
from eagle3.data.readers import (
    dedupe_key,
    first_user_message,
    read_conversations,
    short_pool_warning,
)
from eagle3.data.split import split_indices  # noqa: E402
from eagle3.errors import UserError  # noqa: E402
from eagle3.io import atomic_write_json, atomic_write_text  # noqa: E402
from eagle3.io.read import iter_jsonl

log = logging.getLogger(__name__)

SHAREGPT_ID = r"^[A-Za-z0-9]{7}_\d+$"


def split_seen_heldout(
    prompts: Path, manifest: Path, val_fraction: float, seed: int
) -> tuple[list[dict], list[dict]]:
    """The run's conversations (01's ``prompts.jsonl``) in 03's training and validation splits.

    Args:
        prompts: 01's ``prompts.jsonl`` (``{"id", "messages"}`` per line).
        manifest: 02's ``manifest.jsonl`` (``{"idx", "id", ...}``: sample id -> conversation id).
        val_fraction, seed: ``data.val_fraction`` and ``data.seed`` (03's split).

    Returns:
        ``(train conversations, validation conversations)``, in ``prompts.jsonl`` order; conversations 02 did not
        write (skipped) are in neither.

    Raises:
        UserError: a manifest row without ``idx`` / ``id`` (file:line).
    """
    idx_of = {}
    for lineno, row in iter_jsonl(manifest):
        if not isinstance(row, dict) or "idx" not in row or "id" not in row:
            raise UserError(f"{manifest}:{lineno}: expected a manifest row with 'idx' and 'id'")
        idx_of[str(row["id"])] = int(row["idx"])
    val = set(split_indices(list(idx_of.values()), val_fraction, seed)["val"])
    train, held = [], []
    for _lineno, conv in iter_jsonl(prompts):
        i = idx_of.get(str(conv.get("id")))
        if i is not None:
            (held if i in val else train).append(conv)
    return train, held


def draw(
    convs: list[dict], pattern: str, max_chars: int, n: int, seed: int, label: str = ""
) -> list[str]:
    """First user turns of the conversations whose id matches ``pattern`` and whose first user turn is at most
    ``max_chars`` long: ``n`` of them drawn with ``random.Random(seed)`` (all, in order, when fewer: one warning line
    names ``-n``, the set ``label`` and both counts)."""
    rx = re.compile(pattern)
    pool = [
        u
        for c in convs
        if rx.search(str(c.get("id", ""))) and 0 < len(u := first_user_message(c)) <= max_chars
    ]
    short = short_pool_warning(
        "-n",
        n,
        len(pool),
        f"prompts in the {label + ' ' if label else ''}pool (id pattern, --max-chars {max_chars})",
    )
    if short:
        log.warning("%s", short)
    return pool if len(pool) <= n else random.Random(seed).sample(pool, n)


def unseen_conversations(cfg, used: list[dict]) -> list[dict]:
    """Conversations of ``cfg.prompts.source`` (read as 01 reads them: its format, split, system prompt and think
    tags; prompt-only ones kept) whose dedupe key (01's: the normalised first user message) is not that of any
    conversation in ``used``.

    Raises:
        UserError: a source 01 could not read either (the reader's one-line error).
    """
    pc = cfg.prompts
    keys = {dedupe_key(c) for c in used}
    out = []
    for src in [pc.source] if isinstance(pc.source, str) else list(pc.source):
        out += [
            c
            for c in read_conversations(
                src,
                pc.format,
                hf_split=pc.hf_split,
                keep_prompt_only=True,
                system_prompt=pc.system_prompt,
                think_tags=tuple(cfg.verifier.think_tags),
            )
            if dedupe_key(c) not in keys
        ]
    return out


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--config",
        required=True,
        help="the run's config (prompts.source, data.val_fraction, data.seed)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="the run's overrides",
    )
    p.add_argument("--prompts", type=Path, required=True, help="01's prompts.jsonl of the run")
    p.add_argument(
        "--manifest", type=Path, required=True, help="02's shards/manifest.jsonl of the run"
    )
    p.add_argument(
        "--id-pattern",
        default=SHAREGPT_ID,
        help="regex the conversation ids must match (default: ShareGPT's)",
    )
    p.add_argument(
        "--max-chars", type=int, default=1500, help="longest first user turn drawn, in characters"
    )
    p.add_argument("-n", type=int, default=40, help="prompts per set")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--out",
        type=Path,
        required=True,
        help="folder for chat_{seen,heldout,unseen}.jsonl + fit_sets.json",
    )
    a = p.parse_args(argv)
    cfg = load_config(a.config, a.set)
    train, held = split_seen_heldout(a.prompts, a.manifest, cfg.data.val_fraction, cfg.data.seed)
    unseen = unseen_conversations(cfg, train + held)
    sets = {
        name: draw(convs, a.id_pattern, a.max_chars, a.n, a.seed, name)
        for name, convs in (("seen", train), ("heldout", held), ("unseen", unseen))
    }
    for name, prompts in sets.items():
        atomic_write_text(
            a.out / f"chat_{name}.jsonl",
            "".join(
                json.dumps({"id": f"{name}-{i}", "messages": [{"role": "user", "content": u}]})
                + "\n"
                for i, u in enumerate(prompts)
            ),
        )
    summary = {
        "config": a.config,
        "overrides": a.set,
        "id_pattern": a.id_pattern,
        "max_chars": a.max_chars,
        "seed": a.seed,
        "val_fraction": cfg.data.val_fraction,
        "split_seed": cfg.data.seed,
        "conversations": {"train": len(train), "val": len(held), "unseen": len(unseen)},
        "drawn": {k: len(v) for k, v in sets.items()},
    }
    atomic_write_json(a.out / "fit_sets.json", summary)
    print(json.dumps(summary["drawn"]), "->", a.out)
    return 0


if __name__ == "__main__":
    run_main(main)
