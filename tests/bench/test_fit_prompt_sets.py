"""bench/fit_prompt_sets.py: seen / held-out / unseen first turns of a run, by 03's own split and 01's dedupe key
(the sets are checked against a split computed here by hand)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import fit_prompt_sets as fps  # noqa: E402


def _conv(cid, user):
    return {
        "id": cid,
        "messages": [{"role": "user", "content": user}, {"role": "assistant", "content": "a"}],
    }


def _run(tmp_path):
    """Four ShareGPT-id conversations (samples 0-3) and one pool one, a manifest, and a source file holding two of
    them (case/space variants: 01's dedupe key matches them) plus two never drawn."""
    convs = [
        _conv("aaaaaaa_0", "First"),
        _conv("bbbbbbb_1", "Second"),
        _conv("ccccccc_2", "Third"),
        _conv("ddddddd_3", "x" * 50),
        _conv("pool/7", "Pool prompt"),
    ]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(c) + "\n" for c in convs))
    (tmp_path / "manifest.jsonl").write_text(
        "".join(
            json.dumps({"idx": i, "id": c["id"], "num_tokens": 3}) + "\n"
            for i, c in enumerate(convs)
        )
    )
    src = [
        _conv("aaaaaaa_0", "  first "),
        _conv("eeeeeee_4", "Never drawn"),
        _conv("fffffff_5", "Nor this"),
        _conv("ggggggg_6", "Second"),
    ]
    (tmp_path / "src.jsonl").write_text("".join(json.dumps(c) + "\n" for c in src))
    (tmp_path / "run.yaml").write_text(
        f"run_name: t\nverifier: {{path: x}}\nprompts: {{source: [{tmp_path / 'src.jsonl'}]}}\n"
        "data: {val_fraction: 0.4, seed: 3}\n"
    )
    return tmp_path


def test_sets_follow_the_runs_split(tmp_path):
    import random

    t = _run(tmp_path)
    # 03's split by hand: ids 0..4, n_val = round(0.4 * 5) = 2, random.Random(3).shuffle
    perm = [0, 1, 2, 3, 4]
    random.Random(3).shuffle(perm)
    val = set(perm[:2])
    train, held = fps.split_seen_heldout(t / "prompts.jsonl", t / "manifest.jsonl", 0.4, 3)
    ids = ["aaaaaaa_0", "bbbbbbb_1", "ccccccc_2", "ddddddd_3", "pool/7"]
    assert [c["id"] for c in held] == [ids[i] for i in range(5) if i in val]
    assert [c["id"] for c in train] == [ids[i] for i in range(5) if i not in val]
    # the id pattern drops pool/7, --max-chars 40 drops the 50-character prompt
    both = train + held
    kept = [c["messages"][0]["content"] for c in both if c["id"] not in ("pool/7", "ddddddd_3")]
    assert sorted(kept) == ["First", "Second", "Third"]
    assert fps.draw(both, fps.SHAREGPT_ID, 40, 10, 0) == kept  # fewer than n: all, in order
    assert fps.draw(both, fps.SHAREGPT_ID, 40, 2, 0) == random.Random(0).sample(kept, 2)
    assert fps.draw(both, fps.SHAREGPT_ID, 50, 10, 0) == [
        c["messages"][0]["content"] for c in both if c["id"] != "pool/7"
    ]

    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "fit_prompt_sets.py"),
            "--config",
            str(t / "run.yaml"),
            "--prompts",
            str(t / "prompts.jsonl"),
            "--manifest",
            str(t / "manifest.jsonl"),
            "--out",
            str(t / "sets"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr
    unseen = [json.loads(x) for x in (t / "sets" / "chat_unseen.jsonl").read_text().splitlines()]
    # "  first " and "Second" are drawn conversations under 01's dedupe key: only the two never drawn are unseen
    assert [u["messages"] for u in unseen] == [
        [{"role": "user", "content": "Never drawn"}],
        [{"role": "user", "content": "Nor this"}],
    ]
    summary = json.loads((t / "sets" / "fit_sets.json").read_text())
    assert summary["conversations"] == {"train": 3, "val": 2, "unseen": 2}
    seen = [
        json.loads(x)["messages"][0]["content"]
        for x in (t / "sets" / "chat_seen.jsonl").read_text().splitlines()
    ]
    assert seen == [c["messages"][0]["content"] for c in train if c["id"] != "pool/7"]


def test_bad_manifest_row_is_one_line(tmp_path):
    t = _run(tmp_path)
    (t / "manifest.jsonl").write_text('{"idx": 0, "id": "aaaaaaa_0"}\n{"id": "bbbbbbb_1"}\n')
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "fit_prompt_sets.py"),
            "--config",
            str(t / "run.yaml"),
            "--prompts",
            str(t / "prompts.jsonl"),
            "--manifest",
            str(t / "manifest.jsonl"),
            "--out",
            str(t / "sets"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert (
        r.returncode == 2
        and r.stderr.strip()
        == f"error: {t / 'manifest.jsonl'}:2: expected a manifest row with 'idx' and 'id'"
    )
    assert not (t / "sets").exists()


def test_n_above_the_pool_is_warned(caplog):
    """``-n`` above a set's pool kept them all without a word (the set silently smaller than asked); one warning now
    names the option, the set and both counts."""
    convs = [_conv(f"aaaaaaa_{i}", f"question {i}") for i in range(3)]
    with caplog.at_level("WARNING"):
        assert len(fps.draw(convs, fps.SHAREGPT_ID, 40, 10, 0, "heldout")) == 3
        assert len(fps.draw(convs, fps.SHAREGPT_ID, 40, 2, 0, "seen")) == 2
    assert [r.getMessage() for r in caplog.records] == [
        "-n 10: only 3 prompts in the heldout pool (id pattern, --max-chars 40); keeping all 3"
    ]
