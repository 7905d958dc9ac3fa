"""Reading raw records (list of dicts) from local files or Hugging Face `datasets`.

`read_records` understands `reasoning_gym:TASK?size=N&seed=S` (see `posttrain.data.reasoning_gym`),
`shapes:?size=N&seed=S` (a synthetic visual task, `posttrain.data.shapes`),
`.jsonl` (optionally `.gz`), `.json`, `.parquet`,
local `datasets` folders (`save_to_disk` output or anything
`datasets.load_dataset(path)` can read) and, as a last resort, hub data set
names. `read_prompts` is a thin helper for RL prompt sets.
"""

from __future__ import annotations

import gzip
import json
import os
import socket
from pathlib import Path
from typing import Any, Sequence
from urllib.parse import urlparse

from posttrain.data import reasoning_gym, shapes
from posttrain.data.errors import DataError

__all__ = ["DataError", "PROMPT_FIELDS", "json_error_column", "pick_prompt_field", "read_records", "read_prompts",
           "source_name"]


class RecordList(list):
    """Records of one source, which remember where each came from (for messages that name the line)."""

    def __init__(self, records=(), source: str = "<records>", lines: list[int] | None = None):
        super().__init__(records)
        self.source = source
        self.lines = lines
        self.prompt_field: str | None = None  # `read_prompts`: the field the prompts came from (None: none)

    def __getitem__(self, i):
        got = super().__getitem__(i)
        if isinstance(i, slice):
            part = RecordList(got, self.source, self.lines[i] if self.lines is not None else None)
            part.prompt_field = self.prompt_field
            return part
        return got

    def where(self, i: int) -> str:
        """`FILE, line N` (JSONL) or `SOURCE, record N` (1-based) for record `i`."""
        if self.lines is not None and i < len(self.lines):
            return f"{self.source}, line {self.lines[i]}"
        return f"{self.source}, record {i + 1}"


def source_name(path_or_name: str | os.PathLike, split: str | None = None) -> str:
    name = str(path_or_name)
    return f"{name} [split={split}]" if split else name


def json_error_column(line: str, e: json.JSONDecodeError) -> int:
    """The 1-based column of the fault `e` in one `line` of a JSONL file: json's own, except for a line that ends
    too early, where json points past the newline (column 1 of a next line) and this points just past the line's
    last character."""
    return min(e.pos, len(line.rstrip())) + 1


def _read_jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    records, lines = [], []
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                col = json_error_column(line, e)
                raise DataError(f"{path}:{lineno}:{col}: malformed JSON on line {lineno}: {e.msg} "
                                f"(column {col})") from e
            if not isinstance(obj, dict):
                raise DataError(f"{path}:{lineno}: line {lineno} is a JSON {type(obj).__name__}, "
                                "expected an object")
            records.append(obj)
            lines.append(lineno)
    return RecordList(records, str(path), lines)


def _read_json(path: Path) -> list[dict]:
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{e.lineno}:{e.colno}: malformed JSON on line {e.lineno}: {e.msg} "
                        f"(column {e.colno})") from e
    if isinstance(obj, dict) and isinstance(obj.get("data"), list):
        obj = obj["data"]
    if not isinstance(obj, list):
        raise DataError(f"{path}: expected a JSON list of objects or {{\"data\": [...]}}, "
                        f"found a {type(obj).__name__}")
    for i, rec in enumerate(obj):
        if not isinstance(rec, dict):
            raise DataError(f"{path}: item {i} is a JSON {type(rec).__name__}, expected an object")
    return obj


def _read_parquet(path: Path) -> list[dict]:
    import pyarrow.parquet as pq  # lazy: pyarrow loads only for .parquet files

    try:
        return pq.read_table(path).to_pylist()
    except Exception as e:  # noqa: BLE001 - re-raised naming the file
        raise DataError(f"{path}: cannot read parquet: {e}") from e


def _pick_split(dd: Any, split: str | None, src: str) -> Any:
    """Choose a split of a DatasetDict-like mapping (default: 'train', or the only split)."""
    splits = list(dd.keys())
    if split is None:
        if "train" in splits:
            split = "train"
        elif len(splits) == 1:
            split = splits[0]
        else:
            raise DataError(f"{src}: has splits {splits}; choose one with split=...")
    if split not in splits:
        raise DataError(f"{src}: no split '{split}'; available splits: {splits}")
    return dd[split]


def _read_hf_dir(path: Path, split: str | None) -> list[dict]:
    import datasets  # lazy: datasets (~1.7 s) loads only for a datasets folder

    if (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file() \
            or (path / "state.json").is_file():
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            ds = _pick_split(ds, split, str(path))
        elif split is not None:
            raise DataError(f"{path}: a single-split dataset saved with save_to_disk; "
                            f"split={split!r} cannot be selected")
        return ds.to_list()
    try:
        ds = datasets.load_dataset(str(path))
    except Exception as e:  # noqa: BLE001
        raise DataError(f"{path}: cannot load the folder with datasets.load_dataset: {e}") from e
    return _pick_split(ds, split, str(path)).to_list()


def _hub_reachable(timeout_s: float = 3.0) -> bool:
    """Whether the hub's host resolves and accepts a connection (checked before `datasets` retries for ~30 s)."""
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        with socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)),
                                      timeout=timeout_s):
            return True
    except OSError:
        return False


def _read_hub(name: str, split: str | None) -> list[dict]:
    import datasets  # lazy: datasets (~1.7 s) loads only for a hub data set

    offline = any(os.environ.get(v, "") not in ("", "0") for v in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"))
    if not offline and not _hub_reachable():
        raise DataError(f"data set '{name}': no such local file or folder, and the Hugging Face hub cannot be reached "
                        "to look it up there. Check the path (data files end in .jsonl, .json or .parquet), or set "
                        "HF_DATASETS_OFFLINE=1 to use a data set already in the local cache.")

    try:
        ds = datasets.load_dataset(name)
    except Exception as e:  # noqa: BLE001
        raise DataError(
            f"cannot load data set '{name}': it is not a local file or folder, and loading it from the "
            f"Hugging Face hub failed ({type(e).__name__}: {e}). Check the path, or the network / "
            "HF_DATASETS_OFFLINE setting.") from e
    return _pick_split(ds, split, name).to_list()


def read_records(path_or_name: str | os.PathLike, split: str | None = None) -> list[dict]:
    """All records of a data source as a list of plain dicts.

    Local files: `.jsonl`/`.jsonl.gz` (one object a line; blank lines skipped; a
    malformed line raises a DataError naming file and line), `.json` (a list of
    objects, or `{"data": [...]}`), `.parquet`. Local folders: `save_to_disk`
    output or anything `datasets.load_dataset(folder)` reads. Other strings are
    treated as hub data set names. `split` picks a split of multi-split sources
    (default 'train' or the only one). An empty data set is a DataError.
    """
    src = source_name(path_or_name, split)
    if reasoning_gym.is_reasoning_gym_source(path_or_name):  # generated problems with their own checkers
        return RecordList(reasoning_gym.records(str(path_or_name)), str(path_or_name))
    if shapes.is_shapes_source(path_or_name):  # the synthetic visual task, drawn on the fly
        return RecordList(shapes.records(str(path_or_name)), str(path_or_name))
    path = Path(path_or_name)
    if path.is_file():
        suffixes = "".join(path.suffixes[-2:]) if path.suffix == ".gz" else path.suffix
        if suffixes in (".jsonl", ".jsonl.gz", ".ndjson"):
            records = _read_jsonl(path)
        elif suffixes == ".json":
            records = _read_json(path)
        elif suffixes == ".parquet":
            records = _read_parquet(path)
        else:
            raise DataError(f"{path}: unsupported file type '{suffixes}'; "
                            "expected .jsonl, .jsonl.gz, .json or .parquet")
    elif path.is_dir():
        records = _read_hf_dir(path, split)
    else:
        name = str(path_or_name)
        # Hub names look like "name" or "org/name"; anything else is a missing local path.
        looks_local = (name.startswith((".", "/", "~")) or name.count("/") > 1
                       or path.suffix in (".jsonl", ".ndjson", ".json", ".parquet", ".gz"))
        if looks_local:
            raise DataError(f"data file '{name}' does not exist")
        records = _read_hub(name, split)
    if not records:
        raise DataError(f"data set '{src}' is empty")
    return records if isinstance(records, RecordList) else RecordList(records, src)


#: Fields that hold a prompt, in the order they are tried when the configured one is absent (`posttrain eval`
#: without --prompt-field; `posttrain rl` with the default `data.prompt_field`).
PROMPT_FIELDS = ("prompt", "question", "problem", "messages")


def pick_prompt_field(first: dict, given: str | None, *, fallback: bool = False, optional: bool = False) -> str | None:
    """The field holding a data set's prompts, from its `first` record: `given` when it has it; else, with
    `fallback`, the first of `PROMPT_FIELDS` it has; else None when prompts are `optional` (an environment's
    `reset` makes the conversation), else `given` (whose absence `read_prompts` then reports)."""
    if given is not None and given in first:
        return given
    if fallback:
        for field in PROMPT_FIELDS:
            if field in first:
                return field
    return None if optional else given


def read_prompts(path_or_name: str | os.PathLike | Sequence[dict], *, prompt_field: str | None = "prompt",
                 split: str | None = None, required_fields: Sequence[str] = (), fallback: bool = False,
                 optional: bool = False) -> list[dict]:
    """Records of an RL prompt set, each with its prompt under the key 'prompt'.

    The prompt (a string or a list of chat messages) is read from the field `pick_prompt_field` chooses from
    `prompt_field`, `fallback` and `optional` (the list's `prompt_field` says which; None: the records have no
    prompt and are kept as they are); every other field (answers, metadata) is kept as is. `required_fields`
    are checked to be present too. Accepts a source for `read_records` or a list of dicts.
    """
    if isinstance(path_or_name, (str, os.PathLike)):
        records = read_records(path_or_name, split)
    else:
        records = RecordList(path_or_name)
        if not records:
            raise DataError("prompt set is empty")
    field = pick_prompt_field(records[0], prompt_field, fallback=fallback, optional=optional)
    out = RecordList((), records.source, records.lines)
    out.prompt_field = field
    for i, rec in enumerate(records):
        for name in ((field,) if field is not None else ()) + tuple(required_fields):
            if name not in rec:
                raise DataError(f"{records.where(i)}: the record has no field '{name}' "
                                f"(fields present: {sorted(rec)})")
        new = dict(rec)
        if field is not None:
            new["prompt"] = _prompt_of(new.pop(field), field, records.where(i))
        out.append(new)
    return out


def _prompt_of(prompt: Any, field: str, where: str) -> Any:
    if not (isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt))):
        raise DataError(f"{where}: field '{field}' must be a string or a list of messages, "
                        f"found {type(prompt).__name__}")
    return prompt
