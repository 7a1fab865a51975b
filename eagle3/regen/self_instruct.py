"""User prompts written by the verifier itself (Magpie-style self-instruct, Xu et al. 2024, arXiv 2406.08464), a
prompt source for stage 01.

Given its chat template's text up to where a user message starts (the "pre-query template"), an instruction-tuned
verifier completes a plausible user message, ended by its end-of-turn token. :func:`make` samples ``num`` queries,
keeps those that ended within ``max_query_tokens``, have at least ``min_chars`` characters, are new (01's dedupe key)
and are not in the ``exclude`` files, and writes them as a messages-JSONL (one user turn each) with
``<stem>_report.json`` beside it; equal settings find the file up to date. It runs as ``01 --self-instruct N --out
FILE`` or inside a 01 run (``prompts.self_instruct``, :mod:`eagle3.stages.self_instruct`).
"""

from __future__ import annotations

import gzip
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch
from pydantic import BaseModel, Field
from tqdm import tqdm

from eagle3.chat.template import ChatOptions, render_text
from eagle3.data.readers import dedupe_key, read_conversations
from eagle3.errors import UserError, validated
from eagle3.io import atomic_write_bytes, atomic_write_json, atomic_write_text, read_json
from eagle3.io.read import file_sha256
from eagle3.verifier.load import (
    load_tokenizer,
    load_verifier,
    stop_token_ids,
    weights_differ,
    weights_fingerprint,
)

SENTINEL = "\x00EAGLE3_USER_QUERY\x00"
SOURCE = "self_instruct"


@dataclass(frozen=True)
class SelfInstructSettings:
    """What determines a self-instruct file (recorded in its report; equal settings = up to date).

    Attributes:
        num: queries to sample (before filtering; the file holds at most this many).
        temperature, top_p: sampling (Magpie: 1.0 / 1.0).
        max_query_tokens: token budget of one query; one that has not ended by then is dropped.
        min_chars: shortest query kept (characters, after stripping).
        batch_size: queries sampled per ``generate`` call.
        seed: sampling seed (batch ``b`` seeds ``torch.manual_seed(seed * 1_000_003 + b)``).
        prefix: the pre-query template text (:func:`pre_query_prefix`).
        verifier: the verifier's display name and dtype.
        exclude: files whose first user messages are left out (their paths).
        exclude_sha256: those files' sha256 (None: missing), so an edited exclude file is not "up to date".
        verifier_weights: :func:`eagle3.verifier.load.weights_fingerprint` of the verifier that samples (None: no
            weight file), compared by :func:`eagle3.verifier.load.weights_differ`.
    """

    num: int
    temperature: float
    top_p: float
    max_query_tokens: int
    min_chars: int
    batch_size: int
    seed: int
    prefix: str
    verifier: str
    exclude: tuple = ()
    exclude_sha256: tuple = ()
    verifier_weights: Optional[str] = None


def pre_query_prefix(tokenizer, opts, system_prompt: Optional[str] = None) -> str:
    """The chat template's text before a user message's content: what the verifier continues with a user query.

    Renders ``[system?, user: <sentinel>]`` with the run's template options (01's rendering,
    :func:`eagle3.chat.template.render_text`) and cuts at the sentinel, so a template's default system turn (SmolLM2:
    "You are a helpful AI assistant named SmolLM, ...") is kept as the verifier sees it in regeneration.

    Args:
        tokenizer: the verifier's tokenizer (with a chat template).
        opts: :class:`eagle3.chat.template.ChatOptions`.
        system_prompt: ``prompts.system_prompt`` (None: the template's own default, if any).

    Returns:
        The prefix text, e.g. ``"<|im_start|>system\\n...<|im_end|>\\n<|im_start|>user\\n"`` for ChatML.

    Raises:
        UserError: the template drops or rewrites the user content (the sentinel is not in its output).
    """
    msgs = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
        {"role": "user", "content": SENTINEL}
    ]
    text = render_text(tokenizer, msgs, opts)
    if SENTINEL not in text:
        raise UserError(
            "verifier.chat_template: the template does not render a user message's content as given, so "
            "it has no pre-query text to sample user prompts from (01 --self-instruct)"
        )
    return text[: text.index(SENTINEL)]


def select_queries(
    texts: Sequence[str], ended: Sequence[bool], min_chars: int, seen: set
) -> tuple[list[str], dict]:
    """Filter sampled queries (in order): keep one that ``ended`` on an end-of-turn token, has at least ``min_chars``
    characters after stripping and whose 01 dedupe key is not in ``seen`` (which it is added to).

    Returns:
        ``(kept, counts)``: the stripped queries, and ``{"truncated", "too_short", "duplicate", "kept"}`` counts
        (each query counted once, in that order of checks).
    """
    kept, counts = [], {"truncated": 0, "too_short": 0, "duplicate": 0, "kept": 0}
    for text, done in zip(texts, ended):
        q = text.strip()
        key = dedupe_key({"messages": [{"role": "user", "content": q}]})
        failed = (
            ("truncated", not done),
            ("too_short", len(q) < min_chars),
            ("duplicate", key in seen),
        )
        why = next((w for w, bad in failed if bad), "kept")
        counts[why] += 1
        if why == "kept":
            seen.add(key)
            kept.append(q)
    return kept, counts


@torch.no_grad()
def sample_queries(
    model,
    tokenizer,
    prefix_ids: list[int],
    n: int,
    stop_ids: set[int],
    temperature: float,
    top_p: float,
    max_tokens: int,
    seed: int,
) -> tuple[list[str], list[bool], int]:
    """``n`` sampled continuations of ``prefix_ids`` (one ``model.generate`` call, seeded by ``seed``).

    Args:
        prefix_ids: the pre-query template's token ids.
        stop_ids: token ids that end a user turn (the verifier's end-of-turn set).
        temperature, top_p: sampling; max_tokens: new-token budget.

    Returns:
        ``(texts, ended, tokens)``: each query's text up to (excluding) its first stop token, whether one came
        within ``max_tokens``, and the tokens sampled in all (each query up to and including its stop token).
    """
    dev = next(model.parameters()).device
    ids = torch.tensor([prefix_ids] * n, device=dev)  # [n, P]
    torch.manual_seed(seed)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=True,
        temperature=temperature,
        top_p=top_p,
        top_k=0,
        max_new_tokens=max_tokens,
        eos_token_id=sorted(stop_ids),
        pad_token_id=sorted(stop_ids)[0],
    )[:, len(prefix_ids) :].tolist()  # [n, <= max_tokens]
    texts, ended, tokens = [], [], 0
    for row in out:
        cut = next((j for j, t in enumerate(row) if t in stop_ids), None)
        texts.append(tokenizer.decode(row if cut is None else row[:cut], skip_special_tokens=True))
        ended.append(cut is not None)
        tokens += len(row) if cut is None else cut + 1
    return texts, ended, tokens


def report_path(out: Path) -> Path:
    """``<out stem>_report.json`` beside ``out`` (``.jsonl`` / ``.jsonl.gz`` stripped)."""
    name = out.name
    for ext in (".gz", ".jsonl", ".json"):
        name = name[: -len(ext)] if name.endswith(ext) else name
    return out.with_name(f"{name}_report.json")


def _excluded_keys(paths: Sequence[str], name: str = "--exclude") -> set:
    """01 dedupe keys of every conversation's first user message in ``paths`` (01's readers); a refusal names the
    setting ``name`` (the flag, or ``prompts.self_instruct.exclude``) first."""
    keys: set = set()
    for p in paths:
        try:
            keys |= {dedupe_key(c) for c in read_conversations(str(p), keep_prompt_only=True)}
        except UserError as e:
            raise UserError(
                f"{name}: {e} (an exclude file: prompts to leave out, in a format prompts.source "
                f"reads)"
            ) from e
    return keys


# how messages name the settings: the CLI mode's flags, or prompts.self_instruct's keys (eagle3.stages.self_instruct)
CLI_NAMES = {
    "num": "--self-instruct {num}",
    "max_query_tokens": "--self-instruct-max-tokens",
    "min_chars": "--self-instruct-min-chars",
    "exclude": "--exclude",
    "then": "list it in prompts.source",
}
CONFIG_NAMES = {
    "num": "prompts.self_instruct.num {num}",
    "max_query_tokens": "prompts.self_instruct.max_query_tokens",
    "exclude": "prompts.self_instruct.exclude",
    "min_chars": "prompts.self_instruct.min_chars",
    "then": "added to the sampled sources",
}


def make(
    verifier,
    out: Path,
    num: int,
    *,
    opts: ChatOptions,
    system_prompt: Optional[str],
    seed: int,
    batch_size: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    max_query_tokens: int = 128,
    min_chars: int = 16,
    exclude: Sequence[str] = (),
    force: bool = False,
    names: Optional[dict] = None,
) -> bool:
    """Sample ``num`` user queries from the verifier, filter them, write ``out`` (the CLI mode's and
    ``prompts.self_instruct``'s one code path; the arguments are already checked).

    Args: ``verifier``: the ``verifier:`` config section (:mod:`eagle3.verifier.load`); ``out``: the file to write
    (its folder exists); ``opts``: chat template options (:func:`pre_query_prefix`); ``system_prompt``, ``seed``:
    ``prompts.``'s; the others: :class:`SelfInstructSettings` (``exclude``: its prompts count as seen in
    :func:`select_queries`); ``names``: how messages name the settings (:data:`CLI_NAMES`, the default, or
    :data:`CONFIG_NAMES`).

    Returns True when it sampled and wrote ``out`` and its report, False when ``out`` was up to date (equal
    :class:`SelfInstructSettings`, printed; ``force``: never, its old report removed first). Raises UserError for an
    unusable chat template, an unreadable exclude file, or no query kept (nothing written then).
    """
    names = names or CLI_NAMES
    tok = load_tokenizer(verifier)
    st = SelfInstructSettings(
        num,
        float(temperature),
        float(top_p),
        max_query_tokens,
        min_chars,
        batch_size,
        seed,
        pre_query_prefix(tok, opts, system_prompt),
        f"{verifier.display_name()} ({verifier.dtype})",
        tuple(map(str, exclude)),
        tuple(file_sha256(p) if Path(p).is_file() else None for p in exclude),
        weights_fingerprint(verifier),
    )
    if not force and _up_to_date(out, st):
        print(f"{out}: up to date (same self-instruct settings; --force to sample again)")
        return False
    if force:
        report_path(out).unlink(missing_ok=True)
    seen = _excluded_keys(exclude, names["exclude"])
    n_excluded_keys = len(seen)
    queries, counts, secs, tokens = _sample_all(verifier, tok, st, seen)
    if not queries:
        raise nothing_kept(num, counts, max_query_tokens, min_chars, names)
    write_queries(out, queries)
    _write_report(out, st, counts, n_excluded_keys, secs, tokens)
    print(f"{out}: {_summary(st, counts, secs)}; {names['then']}")
    return True


def _summary(st: SelfInstructSettings, counts: dict, secs: float) -> str:
    """What the sampling kept and dropped, for the closing line."""
    return (
        f"{counts['kept']} self-instruct prompts of {st.num} sampled ({counts['truncated']} unfinished within "
        f"{st.max_query_tokens} tokens, {counts['too_short']} under {st.min_chars} characters, "
        f"{counts['duplicate']} repeated or excluded) in {secs:.1f} s"
    )


def _write_report(
    out: Path, st: SelfInstructSettings, counts: dict, n_excluded: int, secs: float, tokens: int
) -> None:
    """``report_path(out)`` atomically: the settings, the filter counts, the excluded prompts known, the sampling
    time (seconds) and sampled tokens."""
    report = {
        "settings": asdict(st),
        "counts": counts,
        "excluded_prompts_known": n_excluded,
        "seconds": secs,
        "query_tokens": tokens,
        "tokens_per_s": tokens / secs if secs > 0 else None,
        "file": str(out),
    }
    atomic_write_json(report_path(out), report)


def write_queries(out: Path, queries: Sequence[str]) -> None:
    """``out`` atomically: one messages-JSONL row a query (id ``self_instruct/<k>``), gzip-compressed when ``out``
    ends in ``.gz`` (01's readers open such a file through gzip; mtime 0, so equal queries give equal bytes)."""
    text = "".join(
        json.dumps(
            {"id": f"{SOURCE}/{k}", "source": SOURCE, "messages": [{"role": "user", "content": q}]},
            ensure_ascii=False,
        )
        + "\n"
        for k, q in enumerate(queries)
    )
    if out.suffix == ".gz":
        atomic_write_bytes(out, gzip.compress(text.encode("utf-8"), mtime=0))
    else:
        atomic_write_text(out, text)


def nothing_kept(
    num: int, counts: dict, max_query_tokens: int, min_chars: int, names: Optional[dict] = None
) -> UserError:
    """The one-line error for a run that kept no query (no file is written: an empty one would only fail in 01),
    with the counts and what to change (``names``: :data:`CLI_NAMES`, the default, or :data:`CONFIG_NAMES`)."""
    names = names or CLI_NAMES
    hint = []
    if counts["truncated"]:
        hint.append(
            f"raise {names['max_query_tokens']} (now {max_query_tokens}) or use an instruction-tuned verifier"
        )
    if counts["too_short"]:
        hint.append(f"lower {names['min_chars']} (now {min_chars})")
    if counts["duplicate"]:
        hint.append(
            "set another prompts.seed (the same seed samples the same queries: a second file made with it "
            "repeats the first)"
        )
    return UserError(
        f"{names['num'].format(num=num)}: no query kept ({counts['truncated']} unfinished, "
        f"{counts['too_short']} too short, {counts['duplicate']} repeated or excluded), nothing written; "
        + "; ".join(hint)
    )


class SamplingFlags(BaseModel):
    """The self-instruct mode's sampling flags, by name."""

    num: int = Field(ge=1, alias="--self-instruct")
    temperature: float = Field(gt=0, alias="--self-instruct-temperature")
    top_p: float = Field(gt=0, le=1, alias="--self-instruct-top-p")
    max_query_tokens: int = Field(ge=1, alias="--self-instruct-max-tokens")
    min_chars: int = Field(ge=0, alias="--self-instruct-min-chars")


_FLAGS = tuple(f.alias for f in SamplingFlags.model_fields.values())


def check_args(
    num: int,
    temperature: float,
    top_p: float,
    max_query_tokens: int,
    min_chars: int,
    out: Path,
    folder: bool = False,
) -> None:
    """One-line errors for a sampling flag out of range (:class:`SamplingFlags`) or an unusable ``--out``
    (:func:`_out_problem`; ``folder``: it was given with a trailing slash)."""
    args = dict(zip(_FLAGS, (num, temperature, top_p, max_query_tokens, min_chars)))
    validated(SamplingFlags, args, "01 --self-instruct", "pass a value in that range")
    problem = _out_problem(out, folder)
    if problem:
        raise UserError(f"--out {out}{'/' if folder else ''}: {problem}")


def _out_problem(out: Path, folder: bool) -> Optional[str]:
    """Why ``out`` cannot be the self-instruct file, with the fix: a folder, a name 01 would not read as a
    messages-JSONL (``.jsonl`` / ``.jsonl.gz``), a missing folder, or a report name equal to 01's own; else None."""
    stem = out.name.split(".")[0] or "self_instruct"
    if folder or out.is_dir():
        return f"a folder; give the file to write, e.g. {out / 'self_instruct.jsonl'}"
    if not out.name.endswith((".jsonl", ".jsonl.gz")):  # 01 reads .json as one array
        return (
            "the file is a messages-JSONL, which prompts.source reads only under a name ending in .jsonl or "
            f".jsonl.gz; name it e.g. {out.with_name(stem + '.jsonl')}"
        )
    if not out.parent.is_dir():
        return f"folder {out.parent} does not exist"
    if report_path(out).name == "prompts_report.json":
        return (
            f"its report would be {report_path(out)}, the name of 01's own report (which prompts.reuse_answers "
            "and 02 read); choose another name, e.g. self_instruct.jsonl"
        )
    return None


def _up_to_date(out: Path, st: SelfInstructSettings) -> bool:
    """``out`` and its report exist and the report's settings equal ``st`` (``verifier_weights`` compared when both
    the report and ``st`` hold one, not None, as 03/04 and 02 compare 02's record)."""
    rp = report_path(out)
    if not (out.is_file() and rp.is_file()):
        return False
    try:
        rec = read_json(rp)
    except UserError:
        return False
    want = json.loads(json.dumps(asdict(st)))
    got = rec.get("settings") if isinstance(rec, dict) else None
    if isinstance(got, dict) and not weights_differ(
        got.get("verifier_weights"), want["verifier_weights"]
    ):
        # equal, recorded before it was, or no weight file on either side (a hub id's cache, a folder of it now)
        got = {**got, "verifier_weights": want["verifier_weights"]}
    return got == want


def _sample_all(
    verifier, tok, st: SelfInstructSettings, seen: set
) -> tuple[list, dict, float, int]:
    """Sample ``st.num`` queries in batches (tqdm) with the verifier loaded here and freed after (before 01 loads its
    own to answer), filter as they come. Returns ``(queries, counts, seconds, sampled tokens)``."""
    model, _ = load_verifier(verifier)
    stop_ids = stop_token_ids(tok)
    prefix_ids = tok(st.prefix, add_special_tokens=False)["input_ids"]
    queries, counts, tokens = [], {"truncated": 0, "too_short": 0, "duplicate": 0, "kept": 0}, 0
    t0 = time.perf_counter()
    with tqdm(total=st.num, unit="query", desc="self-instruct") as bar:
        for b, start in enumerate(range(0, st.num, st.batch_size)):
            n = min(st.batch_size, st.num - start)
            texts, ended, sampled = sample_queries(
                model,
                tok,
                prefix_ids,
                n,
                stop_ids,
                st.temperature,
                st.top_p,
                st.max_query_tokens,
                st.seed * 1_000_003 + b,
            )
            tokens += sampled
            kept, c = select_queries(texts, ended, st.min_chars, seen)
            queries += kept
            for why, v in c.items():
                counts[why] += v
            bar.update(n)
    return queries, counts, time.perf_counter() - t0, tokens
