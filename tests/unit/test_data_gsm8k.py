"""examples/gsm8k/preprocess.py on tiny fake GSM8K files (parquet and JSONL)."""

import importlib.util
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tidal.data import DataConfig, DataSource
from tidal.data.loaders import load_rows
from tidal.data.prompts import parse_row

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "gsm8k" / "preprocess.py"
ROWS = [
    {"question": "Tom has 3 apples and buys 4 more. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
    {"question": "A car costs $1,200 more than $300. Price?", "answer": "1200+300=1500\n#### 1,500"},
]


@pytest.fixture(scope="module")
def preprocess():
    spec = importlib.util.spec_from_file_location("gsm8k_preprocess", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_parquet_and_jsonl_to_messages_rows(tmp_path, preprocess, capsys):
    pq.write_table(pa.Table.from_pylist(ROWS[:1]), tmp_path / "train.parquet")
    (tmp_path / "more.jsonl").write_text(json.dumps(ROWS[1]) + "\n")
    out = tmp_path / "out" / "train.jsonl"
    assert preprocess.main(["--input", str(tmp_path / "train.parquet"), str(tmp_path / "more.jsonl"), "--output", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["reference"] for r in rows] == ["7", "1500"]
    assert rows[0]["messages"] == [{"role": "user", "content": ROWS[0]["question"] + '\n\nLet\'s think step by step and output the final answer after "####".'}]
    assert rows[1] | {"messages": None} == {"messages": None, "reference": "1500", "label": "gsm8k", "solution": ROWS[1]["answer"], "index": 1}
    parsed = [parse_row(w, r, DataConfig()) for w, r in load_rows(DataSource(path=str(out)))]  # our format
    assert [p.label for p in parsed] == ["gsm8k", "gsm8k"] and parsed[1].metadata == {"solution": ROWS[1]["answer"], "index": 1}


def test_prompt_style_with_boxed_instruction(tmp_path, preprocess):
    (tmp_path / "a.jsonl").write_text(json.dumps(ROWS[0]) + "\n")
    out = tmp_path / "o.jsonl"
    preprocess.main(["--input", str(tmp_path / "a.jsonl"), "--output", str(out), "--style", "prompt", "--answer-format", "boxed"])
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert "messages" not in row and row["prompt"].endswith("put your final answer within \\boxed{}.")


@pytest.mark.parametrize("row, message", [
    ({"question": "q", "answer": "no marker"}, "a.jsonl:2: field 'answer': no '####'"),
    ({"question": "q", "answer": "#### seven"}, "a.jsonl:2: field 'answer': final answer 'seven' is not a number"),
    ({"question": "q"}, "a.jsonl:2: field 'answer': missing"),
    ({"question": 3, "answer": "#### 3"}, "a.jsonl:2: field 'question': a int, not a string"),
])
def test_bad_rows_are_one_line_naming_file_row_and_field(tmp_path, preprocess, capsys, row, message):
    (tmp_path / "a.jsonl").write_text(json.dumps(ROWS[0]) + "\n" + json.dumps(row) + "\n")
    assert preprocess.main(["--input", str(tmp_path / "a.jsonl"), "--output", str(tmp_path / "o.jsonl")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
    assert not (tmp_path / "o.jsonl").exists()


def test_bad_parquet_row_and_missing_file_as_a_script(tmp_path):
    import subprocess
    import sys

    pq.write_table(pa.Table.from_pylist([ROWS[0], {"question": "q", "answer": "7"}]), tmp_path / "t.parquet")
    for inputs, message in [([str(tmp_path / "t.parquet")], "t.parquet row 1: field 'answer': no '####'"),
                            ([str(tmp_path / "nope.jsonl")], "data source not found")]:
        proc = subprocess.run([sys.executable, str(SCRIPT), "--input", *inputs, "--output", str(tmp_path / "o.jsonl")],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
