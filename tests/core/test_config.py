"""The run YAML: strict schema, one-line errors naming the file and field, overrides, derived paths."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from eagle3.config import load_config
from eagle3.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
BASE = "run_name: r\nverifier:\n  path: /models/x\nprompts:\n  source: humaneval\n"


def _write(tmp_path, text: str) -> Path:
    f = tmp_path / "run.yaml"
    f.write_text(text)
    return f


def test_committed_configs_load():
    names = {
        "smollm2-135m": "smollm2-135m",
        "smollm2-135m-full": "smollm2-135m-full",
        "kimi-k2.5": "kimi-k2.5-eagle3",
        "tiny-llama": "tiny-llama",
    }
    for name, run_name in names.items():
        assert load_config(ROOT / "configs" / f"{name}.yaml").run_name == run_name


def test_defaults_and_derived_paths(tmp_path):
    cfg = load_config(_write(tmp_path, BASE))
    assert (
        cfg.train.ttt_length == 7
        and cfg.train.step_weight == 0.8
        and cfg.data.draft_vocab_size == 32000
    )
    assert (
        cfg.extract.aux_layers is None
    )  # = EAGLE default [2, N//2, N-3], resolved against the verifier
    assert cfg.shards_dir == Path("outputs/r/shards") and cfg.export_dir == Path(
        "outputs/r/drafter-sglang"
    )
    cfg = load_config(
        _write(tmp_path, BASE), ["export.engine=vllm", "extract.output_dir=/big/shards"]
    )
    assert cfg.export_dir == Path("outputs/r/drafter-vllm") and cfg.shards_dir == Path(
        "/big/shards"
    )


@pytest.mark.parametrize(
    "extra, message",
    [
        ("train:\n  lrr: 0.1\n", "unknown config key 'train.lrr'"),
        ("trian:\n  lr: 0.1\n", "unknown config key 'trian'"),
        ("train:\n  lr: -0.001\n", "field 'train.lr': Input should be greater than 0"),
        ("train:\n  epochs: many\n", "field 'train.epochs'"),
        ("data:\n  draft_vocab_size: 0\n", "field 'data.draft_vocab_size'"),
        ("extract:\n  aux_layers: [2, 15]\n", "exactly 3 aux layers"),
        ("extract:\n  aux_layers: [0, 15, 27]\n", "must be >= 1"),
        ("extract:\n  aux_layers: [15, 2, 27]\n", "strictly increasing"),
        ("export:\n  engine: trt\n", "field 'export.engine'"),
        (
            "benchmark:\n  datasets: []\n",
            "field 'benchmark.datasets'",
        ),  # was a traceback in 05 after the verifier load
        (
            "benchmark:\n  server_urls: [http://a:1, http://b:2, http://c:3]\n",
            "field 'benchmark.server_urls'",
        ),
    ],
)
def test_bad_fields_name_file_and_field(tmp_path, extra, message):
    f = _write(tmp_path, BASE + extra)
    with pytest.raises(UserError) as e:
        load_config(f)
    assert str(f) in str(e.value) and message in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "text, message",
    [
        # a typo'd key: its line and the closest valid key of its section
        (
            BASE + "train:\n  epochs: 2\n  lrr: 0.1\n",
            "run.yaml:8: unknown config key 'train.lrr' (did you mean 'lr'?)",
        ),
        (
            BASE + "trian:\n  lr: 0.1\n",
            "run.yaml:6: unknown config key 'trian' (did you mean 'train'?)",
        ),
        (
            "run_name: r\nverifier:\n  path: x\n  dtyp: float32\nprompts:\n  source: y\n",
            "run.yaml:4: unknown config key 'verifier.dtyp' (did you mean 'dtype'?)",
        ),
        (
            BASE.replace("prompts:\n", "prompts:\n  server:\n    url: [x]\n"),
            "run.yaml:6: unknown config key 'prompts.server.url' (did you mean 'urls'?)",
        ),
        (
            BASE + "train:\n  zzz_nothing_alike: 1\n",
            "run.yaml:7: unknown config key 'train.zzz_nothing_alike'",
        ),
        # wrong values: the line of the key, also inside a list
        (BASE + "\n\ntrain:\n  epochs: many\n", "run.yaml:9: field 'train.epochs'"),
        (
            BASE + "extract:\n  aux_layers:\n    - 2\n    - x\n    - 27\n",
            "run.yaml:9: field 'extract.aux_layers[1]'",
        ),
        # a missing key: the section lacking it; none for a top-level key
        (
            "run_name: r\nverifier:\n  name: x\nprompts:\n  source: y\n",
            "run.yaml:2: missing required config key 'verifier.path'",
        ),
        (
            "run_name: r\nprompts:\n  source: y\n",
            "run.yaml: missing required config key 'verifier'",
        ),
        # a key given twice in one mapping (safe_load keeps the last silently), also in a list item; top level too
        (
            BASE + "benchmark:\n  num_prompts: 10\n  steps: 3\n  num_prompts: 2\n",
            "run.yaml:9: config key 'benchmark.num_prompts' given twice (first at line 7); keep one",
        ),
        (
            BASE + "train:\n  lr: 0.1\ntrain:\n  epochs: 2\n",
            "run.yaml:8: config key 'train' given twice (first at line 6)",
        ),
        (
            BASE + "prompts2:\n  - {a: 1, a: 2}\n",
            "run.yaml:7: config key 'prompts2[0].a' given twice (first at line 7)",
        ),
    ],
)
def test_file_errors_give_the_line_and_the_closest_key(tmp_path, text, message):
    f = _write(tmp_path, text)
    with pytest.raises(UserError) as e:
        load_config(f)
    assert str(e.value).startswith(str(f.parent) + "/" + message), str(e.value)
    assert str(e.value).endswith("(did you mean 'lr'?)") == ("lrr" in text)


def test_override_errors_name_the_override_with_the_closest_key(tmp_path):
    with pytest.raises(UserError) as e:
        load_config(_write(tmp_path, BASE), ["train.lrr=0.1"])
    assert (
        str(e.value) == "--set train.lrr=0.1: unknown config key 'train.lrr' (did you mean 'lr'?)"
    )


@pytest.mark.parametrize(
    "text, overrides, message",
    [
        (
            BASE + "train:\n  epochs: 2\n  draft_vocab_size: 512\n",
            [],
            "{f}:8: unknown config key 'train.draft_vocab_size' (did you mean 'data.draft_vocab_size'?)",
        ),
        (
            BASE + "benchmark:\n  engine: vllm\n",
            [],
            "{f}:7: unknown config key 'benchmark.engine' (did you mean 'export.engine'?)",
        ),
        (
            BASE + "draft_vocab_size: 512\n",
            [],
            "{f}:6: unknown config key 'draft_vocab_size' (did you mean 'data.draft_vocab_size'?)",
        ),
        (
            BASE,
            ["benchmark.seed=1"],
            "--set benchmark.seed=1: unknown config key 'benchmark.seed' (did you mean "
            "'prompts.seed' or 'data.seed' or 'train.seed'?)",
        ),
    ],
)
def test_a_key_of_another_section_names_the_section_it_belongs_to(
    tmp_path, text, overrides, message
):
    """A field moved between sections (``data.draft_vocab_size`` written under ``train:``, ``export.engine`` under
    ``benchmark:``) said only ``unknown config key 'train.draft_vocab_size'`` (trial 2026-12-05g): a user who knows
    the key exists had to search the schema for its section. The keys of the other sections are now named."""
    f = _write(tmp_path, text)
    with pytest.raises(UserError) as e:
        load_config(f, overrides)
    assert str(e.value) == message.format(f=f)


def test_a_section_an_override_created_blames_the_override_for_its_missing_key(tmp_path):
    """``--set prompts.self_instruct.exclude=x`` on a config without ``prompts.self_instruct`` said
    ``run.yaml:N: missing required config key 'prompts.self_instruct.num'``, N the file's ``prompts:`` line (trial si-2);
    the override made the section, so the error names it. A section of the file still blames the file."""
    f = _write(tmp_path, BASE + "  regenerate: true\n")  # BASE ends in its prompts: section
    with pytest.raises(UserError) as e:
        load_config(f, ["prompts.self_instruct.exclude=mt_bench.jsonl"])
    assert str(e.value) == (
        "--set prompts.self_instruct.exclude=mt_bench.jsonl: missing required config key "
        "'prompts.self_instruct.num'"
    )
    f.write_text(f.read_text() + "  self_instruct:\n    min_chars: 3\n")
    with pytest.raises(UserError) as e:
        load_config(f, ["prompts.self_instruct.exclude=mt_bench.jsonl"])
    assert str(e.value).startswith(f"{f}:") and "'prompts.self_instruct.num'" in str(e.value), str(
        e.value
    )


def test_key_lines_name_every_key_and_list_item():
    """The line map errors are placed by (duplicate keys never reach it: the loader refuses them)."""
    from eagle3.settings.loader import key_lines

    assert key_lines("a: 1\nb:\n  c: 2\n  d: [1, 2]\n") == {
        ("a",): 1,
        ("b",): 2,
        ("b", "c"): 3,
        ("b", "d"): 4,
        ("b", "d", "0"): 4,
        ("b", "d", "1"): 4,
    }
    assert key_lines("a: [1,\n  2]\n") == {("a",): 1, ("a", "0"): 1, ("a", "1"): 2}
    assert key_lines("a: : b\n") == {}


def test_missing_required_and_bad_yaml(tmp_path):
    with pytest.raises(UserError, match="missing required config key 'verifier'"):
        load_config(_write(tmp_path, "run_name: r\nprompts:\n  source: x\n"))
    with pytest.raises(UserError, match=r"run\.yaml:3: malformed YAML"):
        load_config(_write(tmp_path, "run_name: r\nverifier:\n  path: : x\n"))
    with pytest.raises(UserError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(UserError, match="expected section.key=value"):
        load_config(_write(tmp_path, BASE), ["train.lr"])


def test_aux_layer_beyond_verifier_is_refused_with_the_layer_count():
    from eagle3.engines.layers import check_aux_layers

    with pytest.raises(
        UserError,
        match=r"^extract\.aux_layers: aux layers \[2, 15, 30\] must be exactly 3, strictly increasing, in 1\.\.29 "
        r"for a 30-layer verifier",
    ):
        check_aux_layers([2, 15, 30], 30)


@pytest.mark.parametrize(
    "script",
    [
        "01_prepare_prompts.py",
        "02_extract_hidden.py",
        "03_prepare_data.py",
        "04_train.py",
        "05_benchmark.py",
    ],
)
def test_every_stage_exits_2_on_a_misspelled_key(tmp_path, script):
    f = _write(tmp_path, BASE + "train:\n  learning_rate: 0.1\n")
    r = subprocess.run(
        [sys.executable, str(ROOT / script), "--config", str(f)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert r.returncode == 2
    assert (
        r.stderr.strip().splitlines()[-1]
        == f"error: {f}:7: unknown config key 'train.learning_rate'"
    )
    assert not (tmp_path / "outputs").exists()


@pytest.mark.parametrize(
    "override, key",
    [
        ("data.draft_vocab_size=true", "data.draft_vocab_size"),
        ("train.lr=false", "train.lr"),
        ("extract.aux_layers=[true,2,3]", "extract.aux_layers"),
        ("train.max_steps=true", "train.max_steps"),  # Optional[int]
        ("drafter.rope_theta=true", "drafter.rope_theta"),  # Optional[float]
    ],
)
def test_a_boolean_is_never_a_number(tmp_path, override, key):
    """pydantic's lax mode coerced true -> 1 (a 1-token draft vocab); every int/float field refuses it."""
    with pytest.raises(UserError) as e:
        load_config(_write(tmp_path, BASE), [override])
    assert str(e.value).startswith(
        f"--set {override}: field '{key}': expected a number, not a boolean"
    )
    f = _write(tmp_path, BASE + "train:\n  grad_accum: yes\n")
    with pytest.raises(UserError, match=rf"{f}:7: field 'train.grad_accum': .*not a boolean"):
        load_config(f)
    cfg = load_config(_write(tmp_path, BASE + "train:\n  lr: 1\n  compile: true\n"))
    assert cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float) and cfg.train.compile is True


@pytest.mark.parametrize(
    "override,key",
    [
        ('data.draft_vocab_size="32000"', "data.draft_vocab_size"),
        ('train.max_steps="10"', "train.max_steps"),
    ],
)
def test_a_quoted_integer_is_refused(tmp_path, override, key):
    """An int / Optional[int] field refuses a string (lax mode took "32000"); an unquoted 1e-3 is a float
    (ruamel.yaml, YAML 1.1)."""
    with pytest.raises(UserError) as e:
        load_config(_write(tmp_path, BASE), [override])
    assert str(e.value).startswith(
        f"--set {override}: field '{key}': expected an integer, not a string (quoted in the YAML?)"
    )
    f = _write(tmp_path, BASE + 'data:\n  draft_vocab_size: "64"\n')
    with pytest.raises(
        UserError, match=rf"{f}:7: field 'data.draft_vocab_size': expected an integer, not a string"
    ):
        load_config(f)
    cfg = load_config(_write(tmp_path, BASE + "train:\n  lr: 1e-3\n  max_steps: 10\n"))
    assert cfg.train.lr == 0.001 and cfg.train.max_steps == 10


def test_prepare_data_exits_2_on_a_boolean_vocab_size(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "03_prepare_data.py"),
            "--config",
            str(ROOT / "configs/tiny-llama.yaml"),
            "--set",
            "data.draft_vocab_size=true",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert r.returncode == 2
    last = r.stderr.strip().splitlines()[-1]
    assert (
        last.startswith("error: --set data.draft_vocab_size=true: field 'data.draft_vocab_size':")
        and "boolean" in last
    )
    assert not (tmp_path / "outputs").exists()


@pytest.mark.parametrize(
    "line, want",
    [
        ("  regen_compile: true\n", True),
        ("  regen_compile: false\n", False),
        ("  regen_compile: auto\n", "auto"),
        ("", "auto"),
    ],
)
def test_regen_compile_takes_true_false_or_auto(tmp_path, line, want):
    """prompts.regen_compile: YAML true / false as before, or auto (the default: the slot engine decides)."""
    got = load_config(_write(tmp_path, BASE + line)).prompts.regen_compile
    assert got is want if isinstance(want, bool) else got == want


@pytest.mark.parametrize(
    "value",
    [
        "maybe",
        "compile",
        "2",
        "[auto]",
        "null",
        # numbers and quoted booleans: pydantic's lax bool (1 -> True, "yes" -> True) is not applied
        "1",
        "0",
        "'true'",
        "'false'",
        "'yes'",
        "'on'",
        "'1'",
    ],
)
def test_regen_compile_refuses_anything_else_in_one_line(tmp_path, value):
    """prompts.regen_compile: only YAML booleans and auto; anything else one line naming the field, in the file
    (with its line) and through --set."""
    f = _write(tmp_path, BASE + f"  regen_compile: {value}\n")
    with pytest.raises(UserError) as e:
        load_config(f)
    msg = str(e.value)
    assert (
        msg.startswith(f"{f}:6: field 'prompts.regen_compile': ") and "expected true, false" in msg
    ), msg
    assert "or auto" in msg and "\n" not in msg
    with pytest.raises(UserError) as e:
        load_config(_write(tmp_path, BASE), [f"prompts.regen_compile={value}"])
    assert str(e.value).startswith(
        f"--set prompts.regen_compile={value}: field 'prompts.regen_compile': "
    )
    assert "expected true, false" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "key",
    [
        "prompts.dedupe",
        "prompts.regenerate",
        "prompts.regen_cuda_graphs",
        "prompts.regen_prefix_reuse",
        "prompts.regen_prefill_graphs",
        "extract.loss_on_reasoning",
        "train.compile",
        "verifier.trust_remote_code",
    ],
)
@pytest.mark.parametrize("value", ["1", "0", "'yes'", "'true'"])
def test_true_false_fields_take_only_yaml_booleans(tmp_path, key, value):
    """Every bool field refuses a number or a string in one line naming it; true/false still load."""
    with pytest.raises(UserError) as e:
        load_config(_write(tmp_path, BASE), [f"{key}={value}"])
    msg = str(e.value)
    assert (
        msg.startswith(f"--set {key}={value}: field '{key}': ") and "expected true or false" in msg
    ), msg
    assert "\n" not in msg
    section, name = key.split(".")
    for yaml_value, want in (("true", True), ("false", False)):
        got = getattr(
            getattr(load_config(_write(tmp_path, BASE), [f"{key}={yaml_value}"]), section), name
        )
        assert got is want


@pytest.mark.parametrize("key", ["train.bf16", "train.checkpoint_logits"])
def test_on_off_fields_take_unquoted_on_off(tmp_path, key):
    """auto|on|off fields: an unquoted on/off (a YAML boolean to PyYAML) or true/false means "on"/"off"; quoted
    words as before; a number is refused in one line."""
    section, name = key.split(".")
    for value, want in (
        ("on", "on"),
        ("off", "off"),
        ("true", "on"),
        ("false", "off"),
        ("'on'", "on"),
        ("auto", "auto"),
    ):
        f = _write(tmp_path, BASE + f"{section}:\n  {name}: {value}\n")
        assert getattr(getattr(load_config(f), section), name) == want, value
    assert (
        getattr(getattr(load_config(_write(tmp_path, BASE), [f"{key}=on"]), section), name) == "on"
    )
    f = _write(tmp_path, BASE + f"{section}:\n  {name}: 1\n")
    with pytest.raises(UserError) as e:
        load_config(f)
    assert str(e.value).startswith(f"{f}:7: field '{key}': ") and "\n" not in str(e.value)


@pytest.mark.parametrize("value", ["0", "1.5", "-0.1"])
def test_regen_refill_free_is_a_share_of_the_slots(tmp_path, value):
    """prompts.regen_refill_free is in (0, 1]: 0 would never refill a busy engine, > 1 would wait for more than all."""
    f = _write(tmp_path, BASE + "  regen_refill_free: " + value + "\n")
    with pytest.raises(UserError) as e:
        load_config(f)
    assert (
        str(f) in str(e.value)
        and "field 'prompts.regen_refill_free'" in str(e.value)
        and "\n" not in str(e.value)
    )
    assert (
        load_config(
            _write(tmp_path, BASE + "  regen_refill_free: 0.125\n")
        ).prompts.regen_refill_free
        == 0.125
    )
    assert load_config(_write(tmp_path, BASE)).prompts.regen_refill_free == 1 / 32


def test_one_url_string_is_a_list_of_one(tmp_path):
    """prompts.server.urls / benchmark.server_urls written as one URL (as users write it for one server) are read
    as a list of one, in the YAML and in --set; a bad single URL is still refused naming the field."""
    cfg = load_config(
        _write(tmp_path, BASE + "benchmark:\n  server_urls: http://a:1\n"),
        ["prompts.server.urls=http://node1:30000"],
    )
    assert cfg.prompts.server.urls == ["http://node1:30000"] and cfg.benchmark.server_urls == [
        "http://a:1"
    ]
    cfg = load_config(_write(tmp_path, BASE), ["prompts.server.urls=[http://n1:1,http://n2:2]"])
    assert cfg.prompts.server.urls == ["http://n1:1", "http://n2:2"]
    with pytest.raises(UserError, match=r"field 'prompts.server.urls'.*expected http://host:port"):
        load_config(_write(tmp_path, BASE), ["prompts.server.urls=node1:30000"])


def test_every_list_of_strings_field_takes_one_string(tmp_path):
    """The kind of fault behind the one-URL case: every ``list[str]`` field (datasets, exclude_id_prefixes, URLs)
    reads one string as a list of one, in the YAML and in --set; a list-of-ints field does not turn a string into a
    list of it (aux_layers stays refused)."""
    cfg = load_config(
        _write(tmp_path, BASE + "benchmark:\n  datasets: mtbench\n"),
        ["data.exclude_id_prefixes=nl2bash/"],
    )
    assert cfg.benchmark.datasets == ["mtbench"] and cfg.data.exclude_id_prefixes == ["nl2bash/"]
    cfg = load_config(_write(tmp_path, BASE), ["benchmark.datasets=humaneval"])
    assert cfg.benchmark.datasets == ["humaneval"]
    with pytest.raises(UserError, match="field 'extract.aux_layers'"):
        load_config(_write(tmp_path, BASE), ["extract.aux_layers=x"])


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "prompts.source=[a.jsonl, 5]",
            "field 'prompts.source[1]': must be a string, not a number (got 5)",
        ),
        (
            "prompts.source=[a.jsonl, true]",
            "field 'prompts.source[1]': must be a string, not a boolean (got True)",
        ),
        (
            "prompts.source=",
            "field 'prompts.source': expected a string or a list of strings, not null (got None)",
        ),
        (
            "prompts.source={a: 1}",
            "field 'prompts.source': expected a string or a list of strings, not a mapping (got {'a': 1})",
        ),
        (
            "extract.sglang_url=[http://a:1, 5]",
            "field 'extract.sglang_url[1]': must be a string, not a number (got 5)",
        ),
        (
            "extract.capture_dir=7",
            "field 'extract.capture_dir': expected a string or a list of strings, not a number (got 7)",
        ),
    ],
)
def test_a_string_or_list_field_names_itself_and_the_bad_item(tmp_path, override, message):
    """A string-or-list-of-strings field given something else named pydantic's first Union branch, a key that does not
    exist, and hid that a list is fine: ``field 'prompts.source.str': Input should be a valid string (got ['a.jsonl',
    5])``. The field and the bad item are named; null stays fine where the field is optional."""
    with pytest.raises(UserError) as e:
        load_config(_write(tmp_path, BASE), [override])
    assert str(e.value) == f"--set {override}: {message}"
    f = _write(tmp_path, BASE.replace("source: humaneval", "source: [a.jsonl, 5]"))
    with pytest.raises(UserError) as e:
        load_config(f)
    assert (
        str(e.value) == f"{f}:5: field 'prompts.source[1]': must be a string, not a number (got 5)"
    )
    assert load_config(
        f, ["prompts.source=[a.jsonl, b.jsonl]", "extract.sglang_url=null"]
    ).prompts.source == ["a.jsonl", "b.jsonl"]


@pytest.mark.parametrize("name", ["..", "../x", "a/../..", ".", "''", "' '", "a\\\\..\\\\.."])
def test_a_run_name_that_is_not_a_folder_under_outputs_is_refused(tmp_path, name):
    """The run's folder is ``outputs/<run_name>``: ``run_name: ..`` wrote ``prompts.jsonl`` and ``shards/`` into the
    current folder (the repository, for a user running from there), and a blank name or ``.`` into ``outputs/``
    itself; they are refused naming the key, sub-folders stay fine."""
    with pytest.raises(UserError) as e:
        load_config(_write(tmp_path, BASE), [f"run_name={name}"])
    assert str(e.value).startswith(
        f"--set run_name={name}: field 'run_name': a folder name under outputs/ "
        "(sub-folders allowed), not blank, '.' or with a '..' part (set output_root"
    )
    f = _write(tmp_path, BASE.replace("run_name: r", "run_name: .."))
    with pytest.raises(
        UserError, match=r"run\.yaml:1: field 'run_name': a folder name under outputs/"
    ):
        load_config(f)
    assert load_config(f, ["run_name=exp/v1.2"]).root == Path("outputs/exp/v1.2")


def test_a_later_set_below_an_earlier_set_value_names_the_earlier_override():
    """`--set train=1 --set train.output_dir=x` blamed the second override alone ("'train' is a value, not a
    section"), though the user never wrote train as a value there (fresh-user trial 2026-12-05e); the line now names
    the override that made it one. A value from the file is still reported as before."""
    cfg = ROOT / "configs" / "tiny-llama.yaml"
    with pytest.raises(UserError) as e:
        load_config(cfg, ["train=1", "train.output_dir=/tmp/x"])
    assert (
        str(e.value)
        == "--set train.output_dir=/tmp/x: 'train' is a value (set by --set train=1), not a section"
    )
    with pytest.raises(UserError) as e:
        load_config(cfg, ["run_name.x=1"])
    assert str(e.value) == "--set run_name.x=1: 'run_name' is a value, not a section"


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            "benchmark:\n  datasets:\n    - humaneval\n    - 3\n",
            "run.yaml:9: field 'benchmark.datasets[1]': Input should be a valid string (got 3)",
        ),
        (
            "benchmark:\n  server_urls: [http://a:1, ftp://b]\n",
            "run.yaml:7: field 'benchmark.server_urls[1]': expected http://host:port, got 'ftp://b'",
        ),
        (
            "data:\n  exclude_id_prefixes:\n    - a/\n    - [b]\n",
            "run.yaml:9: field 'data.exclude_id_prefixes[1]': Input "
            "should be a valid string (got ['b'])",
        ),
        (
            "extract:\n  aux_layers:\n    - 2\n    - 0\n    - 5\n",
            "run.yaml:9: field 'extract.aux_layers[1]': aux layer "
            "indices are HF hidden_states indices and must be >= 1 (got 0)",
        ),
        (
            "extract:\n  sglang_url:\n    - http://a:1\n    - x\n",
            "run.yaml:9: field 'extract.sglang_url[1]': expected http://host:port, got 'x'",
        ),
    ],
)
def test_a_list_item_is_named_field_index_in_brackets(tmp_path, extra, message):
    """Errors about one item of a list read ``field.0`` (pydantic's location joined by dots: ``extract.aux_layers.1``)
    or named the whole list (``field 'benchmark.server_urls': expected http://host:port, got 'ftp://b' (got [...])``);
    the item is now ``field[i]``, as the prompt readers and the lone-surrogate check write it, with its own line and
    value."""
    f = _write(tmp_path, BASE + extra)
    with pytest.raises(UserError) as e:
        load_config(f)
    assert str(e.value) == f"{tmp_path}/{message}"


def test_a_prompts_flag_clash_names_the_list_item(tmp_path, monkeypatch):
    """01's ``--source`` applied over the config: a bad item is ``prompts.source[1]``, not ``prompts.source.1``."""
    from eagle3.stages.prepare_prompts import apply_overrides

    cfg = load_config(_write(tmp_path, BASE))
    with pytest.raises(UserError) as e:
        apply_overrides(cfg, ["a.jsonl", " "], None, None)
    assert str(e.value) == (
        "--source (prompts.source[1]): empty: name a prompts file, 'humaneval' or 'hf:<dataset>' "
        "(got ' ')"
    )


@pytest.mark.parametrize("value", ["ten", "8,000", "10k"])
def test_an_integer_written_as_words_is_not_called_quoted(tmp_path, value):
    """`sample_size: ten` / `draft_vocab_size: 8,000` (unquoted) were refused with `(quoted in the YAML?)`, a hint that
    sends the user looking for quotes that are not there (fresh-user trial 2026-12-05h)."""
    f = _write(tmp_path, BASE + f"data:\n  draft_vocab_size: {value}\n")
    with pytest.raises(UserError) as e:
        load_config(f)
    assert str(e.value) == (
        f"{f}:7: field 'data.draft_vocab_size': expected an integer, not a string (digits only: "
        f"no separators, units or words) (got '{value}')"
    )


def test_a_top_level_output_dir_suggests_output_root(tmp_path):
    """`output_dir: outputs/x` at the top of a run YAML (the run's folder) was answered `did you mean
    'extract.output_dir' or 'data.output_dir' or 'train.output_dir' or 'export.output_dir' or 'benchmark.output_dir'?`,
    five stage folders and not the key meant, `output_root` (fresh-user trial 2026-12-05h)."""
    f = _write(tmp_path, BASE + "output_dir: outputs/x\n")
    with pytest.raises(UserError) as e:
        load_config(f)
    assert str(e.value) == (
        f"{f}:6: unknown config key 'output_dir' (did you mean 'output_root', the run's folder? a "
        f"stage's own folder is its section's output_dir, e.g. 'train.output_dir')"
    )


def test_yaml_booleans_are_pyyaml_s():
    """The config YAML is read as PyYAML reads YAML 1.1: yes / no / on / off / true / false (any of their cases) are
    booleans, the spec's single letters y / Y / n / N stay strings (a verifier folder named ``y``)."""
    from eagle3.settings.loader import parse_yaml

    got = parse_yaml("a: y\nb: N\nc: yes\nd: Off\ne: TRUE\nf: no\ng: 'on'\nh: 1e-3\n")
    assert got == {
        "a": "y",
        "b": "N",
        "c": True,
        "d": False,
        "e": True,
        "f": False,
        "g": "on",
        "h": 0.001,
    }
