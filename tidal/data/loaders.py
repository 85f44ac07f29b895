"""Read the raw rows of one :class:`DataSource` (JSONL, JSON, Parquet, ``save_to_disk`` folders).

Contract: :func:`load_rows` returns every row of the source in file order as ``(where, row)`` pairs,
``where`` being the human-readable location used in error messages (``file.jsonl:12`` for the
12th line of a JSONL file, ``file.parquet row 3`` (0-based) for the others). A row that is not a
JSON object, a line that is not valid JSON, text that is not UTF-8, or a row nesting lists/objects
deeper than :data:`~tidal.rewards.types.MAX_NESTING` levels (a reward worker process could not be
handed it) raises ``ValueError`` naming file and line (and the column of the first invalid byte).
This module knows nothing about prompts, tokenizers or field mapping.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from tidal.config_base import ConfigError, decode_utf8
from tidal.data.config import DataSource
from tidal.files import check_regular, open_regular
from tidal.rewards.types import MAX_NESTING, nesting_depth

Row = dict[str, Any]


def resolve_format(source: DataSource) -> str:
    """The concrete format of ``source`` (``auto`` resolved from the suffix or folder)."""
    if source.format != "auto":
        return source.format
    path = Path(source.path)
    if path.is_dir():
        return "hf_disk"
    by_suffix = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet"}
    if path.suffix.lower() not in by_suffix:
        raise ValueError(
            f"{source.path}: cannot tell the format from the suffix '{path.suffix}'; "
            f"set format to one of jsonl, json, parquet, hf_disk"
        )
    return by_suffix[path.suffix.lower()]


def check_source(source: DataSource, key: str) -> None:
    """ConfigError at ``key`` (the source's ``path``) unless its path is there and is what its format
    reads: a folder (``save_to_disk``) or a regular file, not a named pipe (a read would block
    forever), a device, a socket or a symlink loop. Said before anything loads."""
    if not os.path.lexists(source.path):
        raise ConfigError(key, f"{source.path!r} does not exist")
    if source.format in ("auto", "hf_disk") and os.path.isdir(source.path):
        return
    try:
        check_regular(source.path, "data file")
    except (OSError, ValueError) as e:
        raise ConfigError(key, str(e)) from None


def load_rows(source: DataSource) -> list[tuple[str, Row]]:
    """All rows of ``source`` as ``(where, row)``; see the module docstring."""
    path = Path(source.path)
    if not os.path.lexists(path):
        raise FileNotFoundError(f"data source not found: {source.path}")
    fmt = resolve_format(source)
    if fmt != "hf_disk":  # a named pipe would block the read forever, a device never end
        check_regular(path, "data file")
    if fmt == "jsonl":
        rows = _load_jsonl(path)
    elif fmt == "json":
        rows = _check_objects(path, _load_json(path))
    elif fmt == "parquet":
        import pyarrow.parquet as pq

        rows = _check_objects(path, pq.read_table(path).to_pylist())
    else:
        rows = _check_objects(path, _load_hf_disk(path))
    for where, row in rows:
        if nesting_depth(row, MAX_NESTING + 1) > MAX_NESTING + 1:  # the row's own object + its fields' values
            raise ValueError(f"{where}: a field nests lists/objects deeper than {MAX_NESTING} levels (a reward "
                             "worker process could not be handed it); flatten it")
    return rows


def _load_jsonl(path: Path) -> list[tuple[str, Row]]:
    rows = []
    with open_regular(path, "rb", what="data file") as f:
        for line_no, raw in enumerate(f, start=1):
            where = f"{path}:{line_no}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{where}: not UTF-8 text: byte 0x{raw[e.start]:02x} at column {e.start + 1}: {e.reason}") from None
            if not line.strip():
                continue
            line = line.rstrip("\r\n")  # else a line that ends too early is reported at column 1 of the next
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: invalid JSON ({e.msg} at column {e.colno}){json_hint(e)}") from None
            except (ValueError, RecursionError) as e:  # an integer too long to convert, nesting too deep
                raise ValueError(f"{where}: invalid JSON ({type(e).__name__}: {str(e) or 'nested too deeply'})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
            rows.append((where, row))
    return rows


_JSON_HINTS = (  # (the start of json's message, the likely cause)
    ("Expecting property name", "a trailing comma before '}', or a key not in double quotes?"),
    ("Expecting ',' delimiter", "a comma missing between two items, or an unescaped '\"' inside a string?"),
    ("Expecting ':' delimiter", "a key without its ':' and value?"),
    ("Unterminated string", "a string not closed, or a '\"' inside it not escaped as \\\"?"),
    ("Invalid control character", "a raw tab or line break inside a string: write it as \\t or \\n"),
    ("Invalid \\escape", "a backslash not escaped: write it as \\\\"),
    ("Extra data", "more than one JSON value where one is expected (JSONL: one object per line)"),
    ("Expecting value", "a missing value, or one JSON does not have (single quotes, NaN, a trailing comma)?"),
)


def json_hint(e: json.JSONDecodeError) -> str:
    """``: <the likely cause>`` of a JSON error, for the message (empty when none is known). Text that
    ends before its value does is an object or list left open, whatever json's message says."""
    if e.pos >= len(e.doc.rstrip()):
        return ": the text ends before the JSON value does (an object or list left open: a '}' or ']' missing at the end?)"
    hint = next((h for start, h in _JSON_HINTS if e.msg.startswith(start)), "")
    return f": {hint}" if hint else ""


def _load_json(path: Path) -> list[Any]:
    with open_regular(path, "rb", what="data file") as f:
        text = decode_utf8(f.read(), str(path))
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{e.lineno}: invalid JSON ({e.msg} at column {e.colno}){json_hint(e)}") from None
    except (ValueError, RecursionError) as e:  # an integer too long to convert, nesting too deep
        raise ValueError(f"{path}: invalid JSON ({type(e).__name__}: {str(e) or 'nested too deeply'})") from None
    if not isinstance(data, list):
        raise ValueError(f"{path}: a .json source must hold a list of rows, got {type(data).__name__}")
    return data


def _check_objects(path: Path, rows: list[Any]) -> list[tuple[str, Row]]:
    out = []
    for i, row in enumerate(rows):
        where = f"{path} row {i}"
        if not isinstance(row, dict):
            raise ValueError(f"{where}: a row must be an object, got {type(row).__name__}")
        out.append((where, row))
    return out


def _load_hf_disk(path: Path) -> list[Row]:
    """Rows of a ``datasets.Dataset.save_to_disk`` folder, read with pyarrow (``datasets`` not needed).

    The folder holds ``state.json`` (listing the Arrow files in order under ``_data_files``) and
    Arrow IPC *stream* files. A ``DatasetDict`` folder (``dataset_dict.json``) must be given per split.
    """
    import pyarrow as pa

    if not path.is_dir():
        check_regular(path, "data file")  # says what it is when it is not a file either
        raise ValueError(f"{path} is a file; format hf_disk reads a save_to_disk folder")
    if (path / "dataset_dict.json").exists():
        with open_regular(path / "dataset_dict.json") as f:
            splits = json.load(f).get("splits", [])
        raise ValueError(f"{path} is a DatasetDict folder; set path to one split folder, one of {[str(path / s) for s in splits]}")
    state_file = path / "state.json"
    if state_file.exists():
        with open_regular(state_file) as f:
            files = [path / entry["filename"] for entry in json.load(f)["_data_files"]]
    else:
        files = sorted(path.glob("*.arrow"))
    if not files:
        raise ValueError(f"{path}: not a save_to_disk folder (no state.json and no .arrow files)")
    rows: list[Row] = []
    for file in files:
        check_regular(file, "Arrow file")
        with pa.memory_map(str(file), "r") as source:
            try:
                table = pa.ipc.open_stream(source).read_all()
            except pa.ArrowInvalid:  # Arrow IPC file format (not what datasets writes, but accept it)
                source.seek(0)
                table = pa.ipc.open_file(source).read_all()
        rows.extend(table.to_pylist())
    return rows
