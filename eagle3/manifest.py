"""Stage manifests: the one contract between a stage's output folder and the stages that read it.

A stage writes ``{folder}/eagle3_manifest.json`` (:func:`write`, atomic) last, once its outputs are in place: a
:class:`Manifest` subclass naming the stage that wrote it (``written_by``, ``version``), the settings its outputs
were made under and the fingerprints of its inputs. A reader loads it with :func:`read` and compares what it needs
with :func:`require`. Every refusal is one line: the file, the field (its ``title``: the config key it comes from),
``old -> new`` and the stage to re-run. A folder without a manifest, or with one of another version, is refused the
same way: its stage is re-run (no reading of older layouts).

Imports only :mod:`eagle3.io`, :mod:`eagle3.errors` and pydantic (``tests/test_layout.py``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, ClassVar, Mapping, Optional, TypeVar

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictInt,
    ValidationError,
    model_validator,
)

from eagle3.errors import UserError
from eagle3.io import atomic_write_bytes, read_json

FILE = "eagle3_manifest.json"

M = TypeVar("M", bound="Manifest")
Tolerate = Callable[[str, Any, Any], bool]
"""``(field, recorded, now) -> True`` when that difference is accepted."""


class Manifest(BaseModel):
    """A stage output folder's manifest. Subclasses set :attr:`STAGE` (the script that writes the folder) and
    :attr:`VERSION` (raised when a field's meaning changes: older manifests are then refused, their stage re-run)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    STAGE: ClassVar[str]
    VERSION: ClassVar[int] = 1

    written_by: str
    version: int
    _path: Optional[Path] = PrivateAttr(default=None)

    @classmethod
    def make(cls: type[M], **fields: Any) -> M:
        """The manifest of this stage and version with ``fields``."""
        return cls(written_by=cls.STAGE, version=cls.VERSION, **fields)

    @property
    def where(self) -> str:
        """The file it was read from (for messages), or the stage's manifest when built in memory."""
        return str(self._path) if self._path is not None else f"{self.STAGE}'s {FILE}"

    def change(self, name: str, now: Any) -> str:
        """How field ``name`` changed, for :func:`require`'s line: ``<title> <recorded> -> <now>``."""
        return f"{type(self).model_fields[name].title or name} {getattr(self, name)!r} -> {now!r}"

    @classmethod
    def of_record(cls: type[M], record: Mapping[str, Any], where: str | os.PathLike) -> M:
        """A stage's own record (a JSON object as read) as this manifest; ``where`` names it.

        Raises:
            UserError: ``<where>: key '<field>': <what is wrong>; re-run <STAGE>``.
        """
        return cls._of_json(record, where, stamped=False)

    @classmethod
    def _of_json(cls: type[M], raw: Any, where: str | os.PathLike, stamped: bool) -> M:
        """``raw`` (JSON as read from ``where``) as this manifest: the one place a record is refused.

        Args:
            stamped: ``raw`` is a manifest file, whose ``written_by`` / ``version`` must be this stage's and version
                (a fault names its ``field``); else a stage's own record, stamped here (a fault names its ``key``).

        Raises:
            UserError: ``<where>: not a JSON object`` / ``written by <stage> version <n>, this code reads ...`` /
                ``<field|key> '<loc>': <what is wrong>``, each ending ``; re-run <STAGE>``.
        """
        rerun = f"re-run {cls.STAGE}"
        if not isinstance(raw, Mapping):
            raise UserError(f"{where}: not a JSON object; {rerun}")
        made = (raw.get("written_by"), raw.get("version"))
        if stamped and made != (cls.STAGE, cls.VERSION):
            raise UserError(
                f"{where}: written by {made[0]} version {made[1]}, this code reads {cls.STAGE} version "
                f"{cls.VERSION}; {rerun}"
            )
        try:
            found = cls.make(**{k: v for k, v in raw.items() if k not in ("written_by", "version")})
        except ValidationError as e:
            err = e.errors()[0]
            loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
            word = "field" if stamped else "key"
            raise UserError(f"{where}: {word} {loc!r}: {err['msg']}; {rerun}") from None
        found._path = Path(where)
        return found


class DataManifest(Manifest):
    """Stage 03's data folder (``vocab_map.pt``, ``split.json``, ``token_freq.pt``): the ``data:`` settings they were
    made under and the shard set they were made from (04 trains only on a current set)."""

    STAGE: ClassVar[str] = "03_prepare_data.py"

    shards_dir: str = Field(title="extract.output_dir")  # resolved
    shards_fingerprint: str = Field(
        title="the shard set's fingerprint (re-extracted or changed since)"
    )
    draft_vocab_size: int = Field(title="data.draft_vocab_size")
    val_fraction: float = Field(title="data.val_fraction")
    seed: int = Field(title="data.seed")
    train_samples: Optional[int] = Field(title="data.train_samples")
    exclude_id_prefixes: list[str] = Field(title="data.exclude_id_prefixes")

    SETTINGS: ClassVar[tuple[str, ...]] = (
        "draft_vocab_size",
        "val_fraction",
        "seed",
        "train_samples",
        "exclude_id_prefixes",
    )


class ShardsManifest(Manifest):
    """Stage 02's shards folder: the verifier and capture settings its hidden states were made under. Its file is the
    shard codec's ``data_config.json`` (:mod:`eagle3.shards.data_config`, also copied into 04's checkpoints), read
    as this model by :meth:`of_record`; a key an older record lacks is None and not compared."""

    model_config = ConfigDict(extra="ignore", frozen=True)
    STAGE: ClassVar[str] = "02_extract_hidden.py"

    verifier: str = Field(title="verifier (verifier.name / verifier.path)")
    verifier_weights: Optional[str] = Field(None, title="the weights at verifier.path")
    num_layers: Optional[int] = Field(None, title="num_layers at verifier.path")
    hidden_size: Optional[int] = Field(None, title="hidden_size at verifier.path")
    vocab_size: Optional[int] = Field(None, title="vocab_size at verifier.path")
    aux_layers: Optional[list[int]] = Field(None, title="extract.aux_layers")
    max_length: Optional[int] = Field(None, title="extract.max_length")


class ExportVerifier(BaseModel):
    """The ``verifier`` block of an export's ``eagle3_train.json``: the verifier its shards were captured from."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    name: Optional[str] = None
    architecture: Optional[str] = None
    num_layers: Optional[StrictInt] = None
    hidden_size: Optional[StrictInt] = None
    vocab_size: Optional[StrictInt] = None
    weights: Optional[str] = None


class DrafterManifest(Manifest):
    """Stage 04's export folder: its ``eagle3_train.json`` (:mod:`eagle3.export.writer`) read as this model by
    :meth:`of_folder`; 05 compares the HF aux layers, the verifier and the trained ``ttt_length`` with its run, 04's
    ``train.init_from`` the ``drafter_args``. A key an older export lacks is None (05 says which check it could not
    make)."""

    model_config = ConfigDict(extra="ignore", frozen=True)
    STAGE: ClassVar[str] = "04_train.py --export-only"
    FILE: ClassVar[str] = "eagle3_train.json"

    engine: Optional[str] = Field(None, title="engine (export.engine)")
    aux_layers_hf: Optional[list[StrictInt]] = Field(
        None,
        min_length=3,
        max_length=3,
        validation_alias=AliasChoices("aux_layers_hf", "aux_layers"),
        title="aux_layers_hf (the shards' extract.aux_layers)",
    )
    verifier: ExportVerifier = ExportVerifier()
    ttt_length: Optional[StrictInt] = Field(None, title="ttt_length (train.ttt_length)")
    drafter_args: Optional[dict[str, Any]] = Field(None, title="drafter_args (drafter.*)")

    @classmethod
    def of_folder(cls, folder: str | os.PathLike) -> Optional[DrafterManifest]:
        """``{folder}/eagle3_train.json`` as a manifest, or None when there is none (a drafter exported elsewhere).

        Raises:
            UserError: as :meth:`Manifest.of_record` (an unreadable file as :func:`eagle3.io.read_json`).
        """
        path = Path(folder) / cls.FILE
        return cls.of_record(read_json(path), path) if path.is_file() else None


class PromptsManifest(Manifest):
    """Stage 01's ``prompts.jsonl``: the ``settings`` its ``prompts_report.json`` records (every input that decides
    the file; :func:`eagle3.stages.prompts_manifest.settings`), read by :meth:`Manifest.of_record`. A source is one
    ``source`` (+ its ``bytes`` / ``sha256`` when a file) or a ``sources`` list of such; the settings of
    ``prompts.regenerate`` and the keys of :attr:`CONDITIONAL` are None where the settings leave them out."""

    STAGE: ClassVar[str] = "01_prepare_prompts.py"
    # recorded only where they change the output (and, for the weights, where weight files were found): compared
    # only when both sides record one (for the weights: eagle3.verifier.load.weights_differ's rule)
    CONDITIONAL: ClassVar[tuple[str, ...]] = (
        "seed",
        "hf_split",
        "top_p",
        "verifier_dtype",
        "verifier_weights",
    )
    source: list[dict[str, Any]] = Field(title="prompts.source")  # [{source, bytes?, sha256?}]
    format: str = Field(title="prompts.format")
    sample_size: Optional[int] = Field(title="prompts.sample_size")
    dedupe: bool = Field(title="prompts.dedupe")
    chain_conversations: Optional[int] = Field(None, title="prompts.chain_conversations")
    system_prompt: Optional[str] = Field(title="prompts.system_prompt")
    regenerate: bool = Field(title="prompts.regenerate")
    limit: Optional[int] = Field(title="--limit")
    seed: Optional[int] = Field(None, title="prompts.seed")
    hf_split: Optional[str] = Field(None, title="prompts.hf_split")
    think_tags: Optional[list[str]] = Field(None, title="verifier.think_tags")
    self_instruct: Optional[dict[str, Any]] = Field(None, title="prompts.self_instruct")
    max_new_tokens: Optional[int] = Field(None, title="prompts.max_new_tokens")
    max_context_tokens: Optional[int] = Field(
        None, title="max_context_tokens (prompts.max_context_tokens, else extract.max_length)"
    )
    verifier: Optional[str] = Field(None, title="verifier (verifier.name / verifier.path)")
    chat_template: Optional[str] = Field(None, title="verifier.chat_template")
    verifier_dtype: Optional[str] = Field(None, title="verifier.dtype")
    verifier_weights: Optional[str] = Field(None, title="the weights at verifier.path")
    chat_template_kwargs: Optional[dict[str, Any]] = Field(
        None, title="verifier.chat_template_kwargs"
    )
    reply_start: Optional[str] = Field(None, title="verifier.reply_start")
    regenerate_via: Optional[str] = Field(None, title="prompts.regenerate_via")
    temperature: Optional[float] = Field(None, title="prompts.temperature")
    model: Optional[str] = Field(None, title="prompts.server.model")
    extra_body: Optional[dict[str, Any]] = Field(None, title="prompts.server.extra_body")
    top_p: Optional[float] = Field(None, title="prompts.top_p")

    def changed(self, now: PromptsManifest) -> list[str]:
        """The fields whose value ``now`` differs from the recorded one (:func:`differing`), in field order; a
        :attr:`CONDITIONAL` field only when both record it (not None or empty)."""
        every = {k: getattr(now, k) for k in type(self).model_fields}
        return differing(self, every, self._one_side_only)

    @classmethod
    def _one_side_only(cls, name: str, old: Any, now: Any) -> bool:
        return name in cls.CONDITIONAL and bool({old, now} & {None, ""})

    @model_validator(mode="before")
    @classmethod
    def _one_source_list(cls, data: Any) -> Any:
        """``source`` (+ ``bytes`` / ``sha256``) or a ``sources`` list, as recorded, into one list of fingerprints."""
        if not isinstance(data, dict) or isinstance(data.get("source"), list):
            return data
        data = dict(data)
        if "sources" in data:
            many = data.pop("sources")
            data["source"] = [x if isinstance(x, dict) else {"source": x} for x in many or []]
        elif "source" in data:
            fp = {k: data.pop(k) for k in ("source", "bytes", "sha256") if k in data}
            data["source"] = [fp]
        return data

    def change(self, name: str, now: Any) -> str:
        """A source by its names, or ``the content of <file> changed`` (never its hashes); ``prompts.self_instruct``
        one ``prompts.self_instruct.<key> <old> -> <new>`` per changed key; values cut to 200 characters."""
        if name == "source":
            return _source_change(self.source, now)
        old = getattr(self, name)
        if name == "self_instruct" and isinstance(old, dict) and isinstance(now, dict):
            return "; ".join(
                f"the content of {now[k]['source']} changed"
                if isinstance(now.get(k), dict)
                and isinstance(old.get(k), dict)
                and old[k].get("source") == now[k].get("source")
                else f"prompts.self_instruct.{k} {_brief(old.get(k))} -> {_brief(now.get(k))}"
                for k in sorted(set(old) | set(now))
                if old.get(k) != now.get(k)
            )
        return f"{type(self).model_fields[name].title} {_brief(old)} -> {_brief(now)}"


def _brief(value: Any, limit: int = 200) -> str:
    """``repr(value)`` cut to ``limit`` characters (a chat template, a mapping) for one line."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _source_change(old: list[dict[str, Any]], now: list[dict[str, Any]]) -> str:
    """``prompts.source <old names> -> <new names>`` when the names differ, else ``the content of <file> changed``
    for each file whose size or SHA-256 differs."""
    names = [[x.get("source") for x in fps] for fps in (old, now)]
    if names[0] != names[1]:
        one = [n[0] if len(n) == 1 else n or None for n in names]
        return f"prompts.source {_brief(one[0])} -> {_brief(one[1])}"
    return "; ".join(
        f"the content of {b.get('source')} changed" for a, b in zip(old, now) if a != b
    )


def encode(manifest: Manifest) -> bytes:
    """The file's bytes (UTF-8 JSON), for a stage that writes its outputs and manifest as one set
    (:func:`eagle3.io.atomic_write_files`)."""
    return (manifest.model_dump_json(indent=2) + "\n").encode("utf-8")


def write(folder: str | os.PathLike, manifest: Manifest) -> Path:
    """``manifest`` to ``{folder}/eagle3_manifest.json`` atomically (:func:`eagle3.io.atomic_write_bytes`); returns
    the path. Write it after the outputs it describes, so a folder with a manifest is a finished one."""
    path = Path(folder) / FILE
    atomic_write_bytes(path, encode(manifest))
    return path


def read(folder: str | os.PathLike, model: type[M]) -> M:
    """``{folder}/eagle3_manifest.json`` as ``model``.

    Raises:
        UserError: one line naming the file and ``model.STAGE`` to re-run: no manifest (a folder made before
            manifests, by hand, or by a stage that stopped), another stage's or version's manifest, or a field
            missing / of the wrong type (named).
    """
    path = Path(folder) / FILE
    if not path.is_file():
        raise UserError(
            f"{folder}: no {FILE} (not made by this version of {model.STAGE}); re-run {model.STAGE}"
        )
    return model._of_json(read_json(path), path, stamped=True)


def differing(
    found: Manifest, needed: Mapping[str, Any], tolerate: Optional[Tolerate] = None
) -> list[str]:
    """The fields of ``needed`` (``{field: value now}``, in its order) whose recorded value differs, less those
    ``tolerate(field, recorded, now)`` accepts."""
    return [
        name
        for name, now in needed.items()
        if getattr(found, name) != now
        and not (tolerate and tolerate(name, getattr(found, name), now))
    ]


def require(found: Manifest, needed: Mapping[str, Any], stage_to_rerun: str) -> None:
    """Stop at the first field of ``needed`` (``{field: value now}``, in its order) whose recorded value differs.

    Raises:
        UserError: ``<file>: <field title> <recorded> -> <now>; re-run <stage_to_rerun>``.
    """
    for name in differing(found, needed)[:1]:
        raise UserError(
            f"{found.where}: {found.change(name, needed[name])}; re-run {stage_to_rerun}"
        )
