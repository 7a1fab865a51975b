"""The run YAML: one pydantic schema, strict (unknown keys are errors), with derived paths.

Every stage reads the same file (``configs/*.yaml``). Relative paths are relative to the current
working directory. A field left ``null`` takes the default documented next to it, often read off
the verifier (e.g. the drafter's hidden size). Each section is its own model (``eagle3/settings/<section>.py``);
:mod:`eagle3.settings.loader` reads the YAML and words its errors.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Optional

from pydantic import Field, ValidationError, field_validator
from ruamel.yaml.error import YAMLError

from eagle3.errors import UserError
from eagle3.io.read import lone_surrogate_error, lone_surrogate_field
from eagle3.settings.benchmark import BenchmarkConfig
from eagle3.settings.data import DataConfig
from eagle3.settings.drafter import DrafterConfig
from eagle3.settings.export import ExportConfig
from eagle3.settings.extract import ExtractConfig
from eagle3.settings.loader import (
    apply_overrides,
    format_validation_error,
    key_lines,
    parse_yaml,
    read_config_text,
    yaml_error,
)
from eagle3.settings.prompts import PromptsConfig
from eagle3.settings.train import TrainConfig
from eagle3.settings.types import Section
from eagle3.settings.verifier import VerifierConfig


class RunConfig(Section):
    """One run: every stage's settings. See configs/smollm2-135m.yaml for a commented example."""

    run_name: str
    output_root: Optional[str] = Field(None, description="default outputs/{run_name}")

    @field_validator("run_name")
    @classmethod
    def _run_name_is_a_folder_name(cls, v: str) -> str:
        """The run's folder is ``outputs/<run_name>`` (unless ``output_root``): a blank name, ``.`` or a ``..`` part would
        put the outputs in ``outputs/`` itself (every run's parent) or outside it (``..``: ``prompts.jsonl`` and
        ``shards/`` in the current folder), so they are refused; sub-folders (``exp/v1``) are fine."""
        parts = [p.strip() for p in v.replace("\\", "/").split("/")]
        if ".." in parts or not [p for p in parts if p not in ("", ".")]:
            raise ValueError(
                "a folder name under outputs/ (sub-folders allowed), not blank, '.' or with a '..' part "
                "(set output_root for a folder elsewhere)"
            )
        return v

    verifier: VerifierConfig
    prompts: PromptsConfig
    extract: ExtractConfig = Field(default_factory=ExtractConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    drafter: DrafterConfig = Field(default_factory=DrafterConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    export: ExportConfig = Field(default_factory=ExportConfig)
    benchmark: BenchmarkConfig = Field(default_factory=BenchmarkConfig)

    # ---- derived paths -------------------------------------------------------------------
    def output_field(self, folder: str) -> str:
        """The config field that places the output folder ``folder`` (``prompts`` = the run folder, ``shards``,
        ``data``, ``train``, ``export``, ``bench``): the stage's own ``output_dir`` when set, else ``output_root``
        (``output_root (default outputs/<run_name>)`` when that is unset), for errors about the folder."""
        section = {
            "prompts": None,
            "shards": self.extract,
            "data": self.data,
            "train": self.train,
            "export": self.export,
            "bench": self.benchmark,
        }[folder]
        if section is not None and section.output_dir:
            return {"shards": "extract", "bench": "benchmark"}.get(folder, folder) + ".output_dir"
        return (
            "output_root" if self.output_root else f"output_root (default outputs/{self.run_name})"
        )

    @property
    def root(self) -> Path:
        return Path(self.output_root or f"outputs/{self.run_name}")

    @property
    def prompts_path(self) -> Path:
        """Stage 01 output: JSONL ``{id, messages:[{role, content}]}``."""
        return self.root / "prompts.jsonl"

    @property
    def self_instruct_path(self) -> Path:
        """Stage 01's self-instruct prompts (``prompts.self_instruct``): messages-JSONL beside ``prompts.jsonl``."""
        return self.root / "self_instruct.jsonl"

    @property
    def shards_dir(self) -> Path:
        return Path(self.extract.output_dir) if self.extract.output_dir else self.root / "shards"

    @property
    def data_dir(self) -> Path:
        return Path(self.data.output_dir) if self.data.output_dir else self.root / "data"

    @property
    def train_dir(self) -> Path:
        return Path(self.train.output_dir) if self.train.output_dir else self.root / "train"

    @property
    def export_dir(self) -> Path:
        return (
            Path(self.export.output_dir)
            if self.export.output_dir
            else self.root / f"drafter-{self.export.engine}"
        )

    @property
    def bench_dir(self) -> Path:
        return Path(self.benchmark.output_dir) if self.benchmark.output_dir else self.root / "bench"


def load_config(path: str | os.PathLike, overrides: Optional[list[str]] = None) -> RunConfig:
    """Load and validate a run YAML.

    Args:
        path: YAML file.
        overrides: ``section.key=value`` strings (value parsed as YAML,
            :func:`eagle3.settings.loader.apply_overrides`) applied before validation; errors caused by one name it
            (``--set train.lr=x: ...``).

    Raises:
        UserError: one line: missing/unreadable file, bad YAML or a key given twice (with line), not a mapping, bad
            override, unknown key, wrong type or range (with field).
    """
    path = Path(path)
    text = read_config_text(path)
    try:
        raw = parse_yaml(text)
    except YAMLError as e:
        raise yaml_error(path, e, text) from e
    if not isinstance(raw, dict):
        raise UserError(f"{path}: the config must be a YAML mapping (got {type(raw).__name__})")
    applied = apply_overrides(raw, list(overrides or []))
    _refuse_lone_surrogate(raw, path, applied, text)
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as e:
        raise UserError(
            format_validation_error(path, e, RunConfig, applied, key_lines(text), raw)
        ) from e


def _refuse_lone_surrogate(raw: dict, path: Path, applied: dict, text: str) -> None:
    """Refuse a config value holding a lone UTF-16 surrogate (a YAML ``"\\ud83d"`` escape, half of an emoji's pair):
    it would reach ``prompts.jsonl`` (``system_prompt``) or a chat template and fail there with a traceback. The error
    names the ``--set`` that gave it, else the file's line of the key."""
    field = lone_surrogate_field(raw)
    if field is None:
        return
    keys = tuple(re.findall(r"[^.\[\]]+", field))
    where = next((f"--set {t}" for k, t in (applied or {}).items() if keys[: len(k)] == k), None)
    if where is None:
        lines = key_lines(text)
        line = next((lines[keys[:n]] for n in range(len(keys), 0, -1) if keys[:n] in lines), None)
        where = f"{path}:{line}" if line is not None else str(path)
    raise lone_surrogate_error(where, field)


def add_config_args(parser) -> None:
    """Add ``--config`` and repeated ``--set section.key=value`` to an argparse parser."""
    parser.add_argument("--config", "-c", required=True, help="run YAML (see configs/)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override a config field (value parsed as YAML); repeatable",
    )
