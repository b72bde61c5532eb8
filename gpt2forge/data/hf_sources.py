"""``--dataset hf``: where the records come from -- ``--input-files`` resolved to a ``datasets``
source (a ``save_to_disk`` folder, a dataset folder, files, or a name in the local cache), opened
offline into the train and validation splits (run_clm's percentage split), and the text column."""

from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass
from pathlib import Path

from gpt2forge.core import log
from gpt2forge.core.errors import UsageError
from gpt2forge.data.contract import DataRequest

BUILDERS = {".txt": "text", ".json": "json", ".jsonl": "json", ".csv": "csv"}
"""File suffix -> the datasets builder that reads it."""
SPLITS = ("train", "validation")
OFFLINE_HINT = ("on a machine with internet run `python -c \"import datasets; datasets.load_dataset('{name}'{config})"
                ".save_to_disk('DIR')\"` and pass --input-files DIR (or copy that machine's datasets cache into "
                "{cache})")


def import_datasets():
    """The ``datasets`` module, switched offline.

    Raises:
        UsageError: ``datasets`` is not installed.
    """
    os.environ["HF_DATASETS_OFFLINE"] = os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        import datasets
        from huggingface_hub import constants
    except ImportError:
        raise UsageError("--dataset hf needs the Hugging Face `datasets` package: pip install datasets") from None
    # Modules imported before the variables were set (transformers imports huggingface_hub) read them then.
    datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = constants.HF_HUB_OFFLINE = True
    if log.rank() != 0:
        datasets.disable_progress_bars()
    return datasets


@dataclass(frozen=True)
class Source:
    """What ``--input-files`` names: ``kind`` saved | folder | files | name."""

    kind: str
    where: str
    """The path or name, for messages and the cache's name."""
    train_files: tuple[Path, ...] = ()
    valid_files: tuple[Path, ...] = ()

    @property
    def builder(self) -> str:
        return BUILDERS[self.train_files[0].suffix.lower()]


def _expand(entries: tuple[str, ...], flag: str) -> list[Path]:
    files: dict[Path, None] = {}
    for entry in entries:
        matches = [m for m in sorted(glob.glob(entry, recursive=True)) if Path(m).is_file()] \
            if glob.has_magic(entry) else [entry]
        if not matches or not Path(matches[0]).exists():
            raise UsageError(f"{flag} {entry}: {'matches no file' if glob.has_magic(entry) else 'no such file'} "
                             "(--dataset hf reads .txt, .json, .jsonl or .csv files, one datasets folder, or a "
                             "dataset name in the local datasets cache)")
        if Path(matches[0]).is_dir():
            raise UsageError(f"{flag} {entry} is a folder; --dataset hf reads one datasets folder alone, or files")
        files.update(dict.fromkeys(Path(m) for m in matches))
    return list(files)


def _one_builder(files: list[Path], flag: str) -> str:
    for f in files:
        if f.suffix.lower() not in BUILDERS:
            raise UsageError(f"{flag} {f}: --dataset hf reads .txt, .json, .jsonl or .csv files (or a datasets "
                             f"folder), not '{f.suffix}'; convert it, or save it with datasets' save_to_disk")
    builders = {BUILDERS[f.suffix.lower()] for f in files}
    if len(builders) > 1:
        raise UsageError(f"{flag} {' '.join(map(str, files))}: mixed kinds ({', '.join(sorted(builders))}); "
                         "give files of one kind: all .txt, all .json/.jsonl or all .csv")
    return builders.pop()


def resolve_source(req: DataRequest) -> Source:
    """Classify ``req.data.input_files`` (module doc).

    Raises:
        UsageError: missing files, mixed or unsupported kinds, validation files without training files.
    """
    entries = req.data.input_files
    if not entries:
        raise UsageError("--dataset hf needs --input-files: a datasets folder, a dataset name, or .txt/.json/"
                         ".jsonl/.csv files")
    first = entries[0]
    if len(entries) == 1 and Path(first).is_dir():
        saved = (Path(first) / "dataset_dict.json").is_file() or (Path(first) / "state.json").is_file()
        source = Source("saved" if saved else "folder", first)
    elif (len(entries) == 1 and not Path(first).exists() and not glob.has_magic(first)
          and re.fullmatch(r"[\w-][\w.-]*(/[\w.-]+)?", first) and Path(first).suffix.lower() not in BUILDERS):
        source = Source("name", first)
    else:
        train = _expand(entries, "--input-files")
        valid = _expand(req.data.valid_data_path, "--valid-data-path") if req.data.valid_data_path else []
        _one_builder(train + valid, "--input-files" if not valid else "--input-files/--valid-data-path")
        return Source("files", str(train[0]), tuple(train), tuple(valid))
    if req.data.valid_data_path:
        raise UsageError(f"--valid-data-path goes with --input-files files; {first} is a dataset, whose "
                         "validation split (or --validation-split-percentage) is used")
    return source


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    cause = exc.__cause__  # datasets wraps a builder's failure ("An error occurred ...") around its reason
    if cause is not None and str(cause).strip() and str(cause) not in str(exc):
        text += f" ({' '.join(str(cause).split())})"
    return text[:600]


def open_raw(source: Source, req: DataRequest, datasets) -> dict:
    """The raw splits ``train`` and ``validation`` (None when there is none) as ``datasets.Dataset``.

    Raises:
        UsageError: one line for anything datasets cannot load, naming the path or name.
    """
    try:
        if source.kind == "saved":
            loaded = datasets.load_from_disk(source.where)
        elif source.kind == "files":
            data_files = {"train": [str(f) for f in source.train_files]}
            if source.valid_files:
                data_files["validation"] = [str(f) for f in source.valid_files]
            options = {"keep_linebreaks": req.data.keep_linebreaks} if source.builder == "text" else {}
            loaded = datasets.load_dataset(source.builder, data_files=data_files, **options)
        else:
            loaded = datasets.load_dataset(source.where, req.data.dataset_config_name)
    except ConnectionError:  # offline and not cached (datasets' message speaks of the hub)
        config = f", '{req.data.dataset_config_name}'" if req.data.dataset_config_name else ""
        cache = datasets.config.HF_DATASETS_CACHE
        raise UsageError(f"--input-files {source.where}: not a local path, and not in the local datasets cache "
                         f"{cache} (nothing is downloaded): "
                         + OFFLINE_HINT.format(name=source.where, config=config, cache=cache)) from None
    except Exception as exc:  # datasets raises many kinds (ValueError, OSError, JSON and Arrow errors)
        hint = ("pass --dataset-config-name NAME" if "Available" in str(exc) else
                "check that it is a datasets folder (save_to_disk, or data files) or .txt/.json/.jsonl/.csv files")
        raise UsageError(f"--input-files {source.where}: datasets could not load it: {type(exc).__name__}: "
                         f"{_one_line(exc)}; {hint}") from None
    if isinstance(loaded, datasets.Dataset):
        loaded = {"train": loaded}
    if "train" not in loaded:
        raise UsageError(f"--input-files {source.where}: no train split (splits: {', '.join(loaded)}); "
                         "save the training records as the train split")
    if "validation" in loaded:
        return {"train": loaded["train"], "validation": loaded["validation"]}
    return dict(zip(SPLITS, percent_split(loaded["train"], req.data.validation_split_percentage, datasets)))


def percent_split(train, percentage: int, datasets) -> tuple:
    """``(train[N%:], train[:N%])`` with datasets' own percent rounding; ``(train, None)`` for 0 %."""
    if percentage == 0:
        return train, None
    n = {"train": len(train)}
    (val,) = datasets.ReadInstruction.from_spec(f"train[:{percentage}%]").to_absolute(n)
    (rest,) = datasets.ReadInstruction.from_spec(f"train[{percentage}%:]").to_absolute(n)
    return train.select(range(rest.from_, rest.to)), train.select(range(val.from_, val.to))


def text_column(train, json_key: str, where: str, datasets) -> str:
    """``json_key`` if it is a column; else the first column when ``json_key`` is the default ``text``.

    Raises:
        UsageError: no such column, or the column does not hold strings.
    """
    columns = train.column_names
    if json_key in columns:
        column = json_key
    elif json_key == "text" and columns:
        column = columns[0]
    else:
        raise UsageError(f"--input-files {where}: no column {json_key!r} (columns: {', '.join(columns) or 'none'}); "
                         "choose the text column with --json-key")
    feature = train.features[column]
    if not (isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string")):
        raise UsageError(f"--input-files {where}: column {column!r} holds {feature}, not text (columns: "
                         f"{', '.join(columns)}); choose the text column with --json-key")
    return column
