"""Reading rows from JSONL, JSON, Parquet and save_to_disk folders; errors name file and line."""

import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tidal.data import DataSource
from tidal.data.loaders import load_rows, resolve_format

ROWS = [{"prompt": "p0", "reference": "1"}, {"prompt": "p1", "reference": "2"}, {"prompt": "p2", "reference": "3"}]


def write_hf_disk(folder, rows, shards=2):
    """A folder laid out like datasets' save_to_disk: state.json + Arrow IPC stream shards."""
    folder.mkdir()
    table = pa.Table.from_pylist(rows)
    names, per = [], -(-len(rows) // shards)
    for i in range(shards):
        name = f"data-{i:05d}-of-{shards:05d}.arrow"
        with pa.OSFile(str(folder / name), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table.slice(i * per, per))
        names.append({"filename": name})
    (folder / "state.json").write_text(json.dumps({"_data_files": names, "_split": "train"}))
    (folder / "dataset_info.json").write_text("{}")
    return folder


def test_jsonl(tmp_path):
    p = tmp_path / "a.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    rows = load_rows(DataSource(path=str(p)))
    assert [r for _, r in rows] == ROWS and rows[2][0] == f"{p}:3"


@pytest.mark.parametrize("line, message", [('{"prompt": "x",}', "invalid JSON"), ("[1, 2]", "a row must be a JSON object, got list")])
def test_jsonl_bad_line(tmp_path, line, message):
    p = tmp_path / "a.jsonl"
    p.write_text(json.dumps(ROWS[0]) + "\n" + line + "\n")
    with pytest.raises(ValueError, match="^" + re.escape(f"{p}:2: ") + message):
        load_rows(DataSource(path=str(p)))


OPEN = '{"prompt": "What is the sum of 12 and 30 in digits", "reference": "42"'  # 70 characters, '}' missing


@pytest.mark.parametrize("line, column, hint", [
    (OPEN, 71, "the text ends before the JSON value does (an object or list left open: a '}' or ']' missing at the end?)"),
    ('{"prompt": "x", "reference": "4",}', 34, "a trailing comma before '}', or a key not in double quotes?"),
    ('{"prompt": "x" "reference": "4"}', 16, "a comma missing between two items, or an unescaped '\"' inside a string?"),
    ("{'prompt': 'x'}", 2, "a trailing comma before '}', or a key not in double quotes?"),
])
def test_malformed_json_is_named_at_its_column_with_a_hint(tmp_path, line, column, hint):
    """Issue 44 item 15: an object left open at column 71 was reported at `column 1` (of the next
    line, as json saw the line's newline), without a hint."""
    assert len(OPEN) == 70
    p = tmp_path / "a.jsonl"
    p.write_text(json.dumps(ROWS[0]) + "\n" + line + "\n")
    with pytest.raises(ValueError) as info:
        load_rows(DataSource(path=str(p)))
    assert str(info.value).startswith(f"{p}:2: invalid JSON (") and f" at column {column}): {hint}" in str(info.value), info.value


def test_json_list(tmp_path):
    p = tmp_path / "a.json"
    p.write_text(json.dumps(ROWS))
    assert [r for _, r in load_rows(DataSource(path=str(p)))] == ROWS
    p.write_text(json.dumps([ROWS[0], "oops"]))
    with pytest.raises(ValueError, match="^" + re.escape(f"{p} row 1: a row must be an object, got str")):
        load_rows(DataSource(path=str(p)))
    p.write_text(json.dumps({"rows": ROWS}))
    with pytest.raises(ValueError, match="must hold a list of rows"):
        load_rows(DataSource(path=str(p)))


def test_parquet(tmp_path):
    p = tmp_path / "a.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), p)
    rows = load_rows(DataSource(path=str(p)))
    assert [r for _, r in rows] == ROWS and rows[1][0] == f"{p} row 1"


def test_hf_disk_folder_in_shard_order(tmp_path):
    folder = write_hf_disk(tmp_path / "ds", ROWS)
    assert resolve_format(DataSource(path=str(folder))) == "hf_disk"
    assert [r for _, r in load_rows(DataSource(path=str(folder)))] == ROWS


def test_dataset_dict_folder_asks_for_a_split(tmp_path):
    folder = tmp_path / "dd"
    folder.mkdir()
    write_hf_disk(folder / "train", ROWS)
    (folder / "dataset_dict.json").write_text(json.dumps({"splits": ["train"]}))
    with pytest.raises(ValueError, match="DatasetDict folder; set path to one split"):
        load_rows(DataSource(path=str(folder)))


def test_format_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="data source not found"):
        load_rows(DataSource(path=str(tmp_path / "missing.jsonl")))
    p = tmp_path / "a.csv"
    p.write_text("x")
    with pytest.raises(ValueError, match="cannot tell the format"):
        load_rows(DataSource(path=str(p)))
    q = tmp_path / "rows.txt"
    q.write_text(json.dumps(ROWS[0]) + "\n")
    assert [r for _, r in load_rows(DataSource(path=str(q), format="jsonl"))] == ROWS[:1]
