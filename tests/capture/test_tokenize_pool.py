"""Stage 02 tokenization over worker processes: identical to the serial path (samples, order,
counts, first error), and the per-conversation costs that made it slow are gone."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from eagle3.capture.tokenize_pool import map_records, resolve_workers
from eagle3.config import RunConfig
from eagle3.errors import UserError
from eagle3.stages.extract import tokenize_prompts

WORDS = (
    "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau "
    "upsilon phi chi psi omega"
).split()


def _text(i: int, n: int) -> str:
    return " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(n))


def _conversations(tok, n: int = 50) -> list[dict]:
    """Varied records: single and multi-turn, system prompts, recorded ``tokens`` (as 01 writes
    them), replies starting with whitespace (token-boundary fallback), long ones (truncated or
    skipped at max_length 96), prompt-only ones (no loss tokens)."""
    out = []
    for i in range(n):
        kind = i % 7
        msgs: list[dict] = []
        if kind in (1, 4):
            msgs.append({"role": "system", "content": f"You are helper {i}."})
        if kind == 0:
            msgs += [
                {"role": "user", "content": _text(i, 5)},
                {"role": "assistant", "content": _text(i + 1, 8)},
            ]
        elif kind == 1:  # multi-turn
            msgs += [
                {"role": "user", "content": _text(i, 3)},
                {"role": "assistant", "content": _text(i, 4)},
                {"role": "user", "content": _text(i + 2, 3)},
                {"role": "assistant", "content": _text(i + 3, 5)},
            ]
        elif kind == 2:  # regenerated: the verifier's own ids recorded
            ids = tok(_text(i, 9), add_special_tokens=False)["input_ids"]
            msgs += [
                {"role": "user", "content": _text(i, 4)},
                {"role": "assistant", "content": tok.decode(ids), "tokens": ids},
            ]
        elif kind == 3:  # long: over max_length
            msgs += [
                {"role": "user", "content": _text(i, 10)},
                {"role": "assistant", "content": _text(i, 90)},
            ]
        elif kind == 4:  # multi-turn, regenerated
            a = tok(_text(i, 3), add_special_tokens=False)["input_ids"]
            b = tok(_text(i + 5, 6), add_special_tokens=False)["input_ids"]
            msgs += [
                {"role": "user", "content": _text(i, 2)},
                {"role": "assistant", "content": tok.decode(a), "tokens": a},
                {"role": "user", "content": _text(i + 1, 2)},
                {"role": "assistant", "content": tok.decode(b), "tokens": b},
            ]
        elif kind == 5:  # reply starting with whitespace: BPE merge across the boundary
            msgs += [
                {"role": "user", "content": _text(i, 3)},
                {"role": "assistant", "content": "  " + _text(i, 3)},
            ]
        else:  # prompt only: no loss tokens
            msgs += [{"role": "user", "content": _text(i, 6)}]
        out.append({"id": f"c{i}", "messages": msgs, "line": i + 1})
    return out


def _cfg(workers: int, too_long: str = "truncate", template: str | None = None) -> RunConfig:
    return RunConfig.model_validate(
        {
            "run_name": "t",
            "verifier": {"path": "unused", "chat_template": template},
            "prompts": {"source": "humaneval"},
            "extract": {"max_length": 96, "too_long": too_long, "tokenize_workers": workers},
        }
    )


def _flat(samples):
    return [(s.idx, s.id, s.input_ids, s.loss_mask) for s in samples]


BOOM_TEMPLATE = (
    "{% for m in messages %}{% if m['content'] == 'BOOM' %}{{ raise_exception('bad record') }}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.mark.parametrize(
    "too_long,template",
    [("truncate", None), ("skip", None), ("truncate", BOOM_TEMPLATE)],
    ids=["truncate", "skip", "render_failures"],
)
def test_parallel_equals_serial(smollm_tokenizer, too_long, template):
    convs = _conversations(smollm_tokenizer)
    if template:
        for i in (8, 22, 23):  # conversations the template refuses: skipped, in file order
            convs[i]["messages"][0] = {"role": "user", "content": "BOOM"}
    ser = tokenize_prompts(smollm_tokenizer, convs, _cfg(1, too_long, template), Path("p.jsonl"))
    par = tokenize_prompts(smollm_tokenizer, convs, _cfg(3, too_long, template), Path("p.jsonl"))
    assert _flat(par[0]) == _flat(ser[0])
    assert par[1] == ser[1] and par[2] == ser[2]  # counts, skipped ids (in order)
    samples, counts, skipped = ser
    # the inputs exercised every branch
    assert counts["skipped_no_loss_tokens"] >= 7
    assert counts["truncated" if too_long == "truncate" else "skipped_too_long"] >= 7
    if template:
        assert counts["skipped_render_failed"] == 3 and skipped["render_failed"] == [
            "c8",
            "c22",
            "c23",
        ]
    assert len(samples) == 50 - sum(v for k, v in counts.items() if k.startswith("skipped"))
    assert [s.idx for s in samples] == list(range(len(samples)))


def _square(_tok, x):
    return x * x


def _fail_on(_tok, x):
    if x in (37, 80):
        raise UserError(f"p.jsonl:{x}: bad record")
    return x


def test_map_records_order_chunks_and_first_error():
    xs = list(range(103))
    assert map_records(_square, None, xs, workers=3, chunk_size=5) == [x * x for x in xs]
    assert map_records(_square, None, xs, workers=1) == [x * x for x in xs]
    for w in (1, 3):  # the first failing record in input order, same type and message
        with pytest.raises(UserError, match=r"^p\.jsonl:37: bad record$"):
            map_records(_fail_on, None, xs, workers=w, chunk_size=4)
    assert resolve_workers(8, 3) == 3 and resolve_workers(1, 1000) == 1
    assert resolve_workers(None, 10) == 1  # too few records for a pool


class _CountingTokenizer:
    """Delegates to a real tokenizer and records what the pipeline asks of it."""

    def __init__(self, tok):
        self._tok = tok
        self.calls = Counter()
        self.template_keys: set[str] = set()

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def __call__(self, *a, **kw):
        return self._tok(*a, **kw)

    def get_vocab(self):
        self.calls["get_vocab"] += 1
        return self._tok.get_vocab()

    def apply_chat_template(self, messages, **kw):
        for m in messages:
            self.template_keys |= set(m)
        return self._tok.apply_chat_template(messages, **kw)


def test_vocab_built_once_and_token_ids_kept_out_of_the_template(smollm_tokenizer):
    """Old code: ``get_vocab()`` (250 ms for SmolLM2) per conversation, and every recorded id of a
    regenerated reply walked by transformers' message normalisation on each rendering."""
    tok = _CountingTokenizer(smollm_tokenizer)
    convs = [
        c
        for c in _conversations(smollm_tokenizer, 21)
        if c["id"] in ("c2", "c4", "c9", "c11", "c16", "c18")
    ]
    assert sum("tokens" in m for c in convs for m in c["messages"]) >= 6
    samples, _, _ = tokenize_prompts(tok, convs, _cfg(1), Path("p.jsonl"))
    assert len(samples) == 6
    assert tok.calls["get_vocab"] == 1
    assert "tokens" not in tok.template_keys and "content" in tok.template_keys
    # ... and the recorded ids are still used verbatim (c2: reply ids right after the assistant header)
    rec = convs[0]["messages"][-1]["tokens"]
    ids = samples[0].input_ids
    start = next(i for i in range(len(ids)) if ids[i : i + len(rec)] == rec)
    assert all(samples[0].loss_mask[start : start + len(rec)])
