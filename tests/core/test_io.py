"""eagle3.io.lock.exclusive_lock: one writer per folder (stage 02, the shard converter); the lock file is removed at the end."""

import pytest

from eagle3.errors import UserError
from eagle3.io import atomic_path, atomic_torch_save, atomic_write_json
from eagle3.io.lock import exclusive_lock
from eagle3.io.read import iter_jsonl


def test_exclusive_lock_refuses_second_holder_and_releases(tmp_path):
    lock = tmp_path / ".lock"
    with exclusive_lock(lock, "another run is writing here"):
        with pytest.raises(UserError, match=r"\.lock: another run is writing here$"):
            with exclusive_lock(lock, "another run is writing here"):
                pass
    with exclusive_lock(lock, "x"):  # released when the first block ended
        assert lock.exists()
    assert not lock.exists()  # a finished run leaves no empty lock file behind


def test_lock_file_removed_by_the_previous_holder_is_not_the_one_held(tmp_path, monkeypatch):
    """The race of deleting a lock file: we open it, the holder unlinks it and exits, another process creates a
    new one. The lock we then obtain on the old (unlinked) file must not count: we must hold the file at the path."""
    import fcntl

    lock = tmp_path / ".lock"
    real_flock, calls = fcntl.flock, []

    def flock(fd, op):
        if not calls:  # first attempt: the holder removed the file we opened, a new one appeared
            lock.unlink()
            lock.write_text("")
        calls.append(fd)
        return real_flock(fd, op)

    monkeypatch.setattr(fcntl, "flock", flock)
    with exclusive_lock(lock, "held"):
        assert len(calls) == 2  # the stale file was dropped and the new one locked
        with open(lock, "a+") as other:
            with pytest.raises(BlockingIOError):
                real_flock(other.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    assert not lock.exists()


@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o027, 0o640), (0o077, 0o600)])
def test_atomic_writes_get_the_umask_mode(tmp_path, umask, mode):
    """Files renamed into place from a mkstemp temp name have open()'s permissions (0o666 & ~umask), not 0o600."""
    import os

    import torch
    from safetensors.torch import save_file

    old = os.umask(umask)
    try:
        atomic_write_json(tmp_path / "a.json", {"x": 1})
        atomic_torch_save({"t": torch.zeros(2)}, tmp_path / "b.pt")
        with atomic_path(tmp_path / "c.safetensors") as t:  # a writer that makes its own 0o600 file
            save_file({"t": torch.zeros(2)}, str(t))
    finally:
        os.umask(old)
    assert (tmp_path / "a.json").stat().st_mode & 0o777 == mode
    assert (tmp_path / "b.pt").stat().st_mode & 0o777 == mode
    assert (tmp_path / "c.safetensors").stat().st_mode & 0o777 == mode


def test_malformed_jsonl_names_line_and_column(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text(
        '{"a": 1}\n{"a": "x\ty"}\n'
    )  # a raw tab inside a string: column 9 of line 2 (1-based)
    with pytest.raises(
        UserError, match=r"bad\.jsonl:2: malformed JSON: Invalid control character at \(column 9\)$"
    ):
        list(iter_jsonl(p))


@pytest.mark.parametrize("ending", ["\n", "\r\n"])
def test_jsonl_line_missing_its_closing_brace_names_the_column_at_its_end(tmp_path, ending):
    """The fresh-user case: line 2 lacks its ``}``; the decoder stops at the line's end (column len + 1), not at
    column 1 of the next line (the line ending used to be parsed with the line)."""
    line2 = '{"id": "p2", "conversations": [{"role": "user", "content": "Write a function that adds two ints."}]'
    assert len(line2) == 99
    p = tmp_path / "bad.jsonl"
    p.write_bytes(('{"id": "p1"}' + ending + line2 + ending + '{"id": "p3"}' + ending).encode())
    with pytest.raises(UserError) as ei:
        list(iter_jsonl(p))
    assert str(ei.value) == f"{p}:2: malformed JSON: Expecting ',' delimiter (column 100)"


def test_prompt_and_eval_readers_report_the_same_column(tmp_path):
    """Every JSONL reader goes through iter_jsonl: stage 01's prompt files and 05's eval sets give the real column."""
    from eagle3.data.record_files import iter_file

    p = tmp_path / "bad.jsonl"
    p.write_text('{"id": "p1"}\n{"id": "p2", "text": "abc"\n')
    with pytest.raises(
        UserError, match=r"bad\.jsonl:2: malformed JSON: Expecting ',' delimiter \(column 27\)$"
    ):
        list(iter_file(p))


def test_bytes_that_are_not_utf8_name_the_file_line_and_column_in_every_json_reader(tmp_path):
    """A byte that is not UTF-8 (a Latin-1 export, a torn copy) in a prompts file, a JSON array, a gzipped JSONL,
    a JSON report or the run YAML: one line naming the file, its line and the byte's column (before: `cannot read:
    'utf-8' codec can't decode byte 0xff in position 131` without a line, and a traceback from 02's prompts.jsonl,
    05's eval sets, prompts.reuse_answers and 01/02's prompts_report.json)."""
    import gzip

    from eagle3.config import load_config
    from eagle3.data.record_files import iter_file
    from eagle3.io import read_json
    from eagle3.stages.prompts_manifest import read_report

    good = (
        b'{"messages": [{"role": "user", "content": "A"}, {"role": "assistant", "content": "B"}]}\n'
    )
    bad = b'{"messages": [{"role": "user", "content": "caf\xe9"}]}\n'
    jl = tmp_path / "p.jsonl"
    jl.write_bytes(
        b"\xef\xbb\xbf" + good + good + bad
    )  # a byte-order mark does not shift the column of line 3
    want = (
        f"{jl}:3: not UTF-8 text: byte 0xe9 at column 47 (byte {3 + 2 * len(good) + 46} of the file); "
        "save the file as UTF-8"
    )
    for reader in (iter_jsonl, iter_file):
        with pytest.raises(UserError) as ei:
            list(reader(jl))
        assert str(ei.value) == want
    gz = tmp_path / "p.jsonl.gz"
    gz.write_bytes(gzip.compress(good + bad))
    with pytest.raises(UserError, match=r"p\.jsonl\.gz:2: not UTF-8 text: byte 0xe9 at column 47 "):
        list(iter_file(gz))
    arr = tmp_path / "a.json"
    arr.write_bytes(
        b'[{"instruction": "a", "input": "", "output": "b"},\n {"instruction": "\xff"}]'
    )
    with pytest.raises(UserError, match=r"a\.json:2: not UTF-8 text: byte 0xff at column 19 "):
        list(iter_file(arr))
    rep = tmp_path / "r.json"
    rep.write_bytes(b'{"settings":\n "\xff"}')
    with pytest.raises(UserError, match=r"r\.json:2: not UTF-8 text: byte 0xff at column 3 "):
        read_json(rep)
    yml = tmp_path / "run.yaml"
    yml.write_bytes(b"run_name: r\n# caf\xe9\n")
    with pytest.raises(UserError, match=r"run\.yaml:2: not UTF-8 text: byte 0xe9 at column 6 "):
        load_config(yml)
    # 01's own report that is not UTF-8 is unreadable (nothing to compare: prompts.jsonl is remade), not a traceback
    yml.write_text(
        f"run_name: r\noutput_root: {tmp_path / 'out'}\nverifier: {{path: /nonexistent}}\n"
        f"prompts: {{source: {jl}}}\n"
    )
    cfg = load_config(yml)
    cfg.prompts_path.parent.mkdir(parents=True)
    cfg.prompts_path.write_bytes(good)
    (cfg.root / "prompts_report.json").write_bytes(b'{"settings": "\xff"}')
    assert read_report(cfg) == (cfg.root / "prompts_report.json", None)


def test_a_lone_surrogate_escape_is_refused_naming_file_line_and_field_by_every_reader(tmp_path):
    """Half of a surrogate pair (``\\ud83d`` without its ``\\ude00``: a cut emoji, common in ShareGPT dumps) parses
    as JSON but is not text: 01 read it and died with a UnicodeEncodeError traceback writing prompts.jsonl (02 and
    05 would have died in the tokenizer). Every reader now refuses it in one line naming the file, the line and the
    field; a whole pair is one character and passes; a config value gives the key's line or the --set."""
    from eagle3.capture.prompts import read_prompts
    from eagle3.config import load_config
    from eagle3.data.eval_prompts import load_prompt_file
    from eagle3.data.record_files import iter_file

    good = '{"id": "a", "messages": [{"role": "user", "content": "A \\ud83d\\ude00"}, {"role": "assistant", "content": "B"}]}'
    bad = '{"id": "b", "messages": [{"role": "user", "content": "C"}, {"role": "assistant", "content": "cut \\uDE00"}]}'
    p = tmp_path / "p.jsonl"
    p.write_text(good + "\n" + bad + "\n")
    want = (
        f"{p}:2: field 'messages[1].content' holds an unpaired UTF-16 surrogate escape (half of a \\uD83D\\uDE00 "
        "pair, e.g. a cut emoji), which is not text: no UTF-8 file or tokenizer takes it; remove it or complete "
        "the pair"
    )
    for reader in (iter_jsonl, iter_file, read_prompts):
        with pytest.raises(UserError) as ei:
            list(reader(p))
        assert str(ei.value) == want
    q = tmp_path / "q.jsonl"
    q.write_text(good + "\n" + '{"prompt": "x \\ud800 y"}\n')
    with pytest.raises(
        UserError, match=r"q\.jsonl:2: field 'prompt' holds an unpaired UTF-16 surrogate"
    ):
        load_prompt_file(q)
    p.write_text(good + "\n")  # a whole pair: one character
    assert [r["messages"][0]["content"] for r in read_prompts(p)] == ["A \U0001f600"]
    arr = tmp_path / "a.json"
    arr.write_text(
        '[{"instruction": "a", "input": "", "output": "b"},\n{"instruction": "c", "input": "\\udc00"}]'
    )
    with pytest.raises(
        UserError, match=r"a\.json:\[1\]: field 'input' holds an unpaired UTF-16 surrogate"
    ):
        list(iter_file(arr))
    yml = tmp_path / "run.yaml"
    yml.write_text(
        'run_name: r\nverifier: {path: /x}\nprompts:\n  source: p.jsonl\n  system_prompt: "hi \\ud83d"\n'
    )
    with pytest.raises(
        UserError, match=r"run\.yaml:5: field 'prompts.system_prompt' holds an unpaired UTF-16"
    ):
        load_config(yml)
    with pytest.raises(UserError) as ei:
        load_config(yml, ['prompts.source="\\udc00"', "prompts.system_prompt=hi"])
    assert str(ei.value).startswith(
        "--set prompts.source=\"\\udc00\": field 'prompts.source' holds an unpaired"
    )


def test_the_lone_surrogate_refusal_reads_the_same_for_a_file_and_the_config(tmp_path):
    """The refusal was worded twice (a file: ``field '...' ... e.g. a cut emoji), which is not text: no UTF-8 file
    or tokenizer takes it``; the config: ``config key '...' ... pair), which is not text``): one wording now, from
    :func:`eagle3.io.read.lone_surrogate_error`, whatever names the place."""
    from eagle3.config import load_config

    tail = (
        "holds an unpaired UTF-16 surrogate escape (half of a \\uD83D\\uDE00 pair, e.g. a cut emoji), which is not "
        "text: no UTF-8 file or tokenizer takes it; remove it or complete the pair"
    )
    p = tmp_path / "p.jsonl"
    p.write_text('{"prompt": "x \\ud800 y"}\n')
    with pytest.raises(UserError) as ei:
        list(iter_jsonl(p))
    assert str(ei.value) == f"{p}:1: field 'prompt' {tail}"
    yml = tmp_path / "run.yaml"
    yml.write_text(
        'run_name: r\nverifier: {path: /x}\nprompts:\n  source: [p.jsonl, "a \\ud83d"]\n'
    )
    with pytest.raises(UserError) as ei:
        load_config(yml)
    assert str(ei.value) == f"{yml}:4: field 'prompts.source[1]' {tail}"


def test_a_missing_input_file_is_refused_by_require_file_with_the_readers_words(
    tmp_path, monkeypatch
):
    """``eagle3.io.read.require_file`` owns "not found": read_json / safe_torch_load name the stage that writes the
    file, the benchmark's prompt files and the shared data folder name their own fix; a folder is not a file."""
    from eagle3.data.eval_prompts import load_prompt_file, shared_file
    from eagle3.io import read_json
    from eagle3.io.read import safe_torch_load

    for reader in (read_json, safe_torch_load):
        with pytest.raises(UserError) as ei:
            reader(tmp_path / "vocab_map.pt")
        assert str(ei.value) == (
            f"{tmp_path / 'vocab_map.pt'}: file not found (03_prepare_data.py writes it: run that stage first)"
        )
    with pytest.raises(UserError) as ei:
        load_prompt_file(tmp_path)
    assert str(ei.value) == (
        f"{tmp_path}: prompt file not found (expected mtbench, humaneval, gsm8k or a JSONL path)"
    )
    monkeypatch.setenv("EAGLE3_SHARED_DATA", str(tmp_path))
    with pytest.raises(UserError) as ei:
        shared_file("eval/gsm8k_test.jsonl", "the long-context source")
    assert str(ei.value) == (
        f"{tmp_path / 'eval/gsm8k_test.jsonl'}: the long-context source not found (set EAGLE3_SHARED_DATA to "
        "the shared data folder holding eval/gsm8k_test.jsonl)"
    )
