"""examples/geo3k/preprocess.py on a tiny fake Geometry3K parquet (image structs with PNG bytes),
and its output read by PromptDataset with a vision-language tokenizer."""

import importlib.util
import io
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from tidal.data import DataConfig, DataSource, PromptDataset
from tidal.models import load_tokenizer

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "geo3k" / "preprocess.py"


@pytest.fixture(scope="module")
def preprocess():
    spec = importlib.util.spec_from_file_location("geo3k_preprocess", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _png(color) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (16, 16), color).save(buf, format="PNG")
    return buf.getvalue()


def test_parquet_to_rows_with_image_files(tmp_path, preprocess, squares_assets):
    rows = [
        {"images": [{"bytes": _png((255, 0, 0)), "path": None}], "problem": "<image>Find x.", "answer": "3"},
        {"images": [{"bytes": _png((0, 0, 255)), "path": "b.png"}], "problem": "What is the area?", "answer": "12.5"},
    ]
    src = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), src)
    assert preprocess.main(["--input", str(src), "--split", "train", "--out-dir", str(tmp_path / "out")]) == 0
    out = [json.loads(line) for line in (tmp_path / "out" / "train.jsonl").read_text().splitlines()]
    assert out[0] == {"prompt": f"<image>Find x.\n\n{preprocess.INSTRUCTION}", "images": ["images/train/00000-0.png"],
                      "reference": "3", "label": "geo3k", "index": 0}
    assert out[1]["prompt"].startswith("<image>What is the area?") and out[1]["reference"] == "12.5"
    assert Image.open(tmp_path / "out" / out[1]["images"][0]).getpixel((0, 0)) == (0, 0, 255)
    proc = load_tokenizer(squares_assets.model_path)
    ds = PromptDataset([DataSource(path=str(tmp_path / "out" / "train.jsonl"))], proc, DataConfig(shuffle=False), seed=0)
    assert ds[1].prompt_ids.count(proc.image_token_id) == 4 and ds[1].mm_inputs["image_grid_thw"].tolist() == [[1, 4, 4]]


@pytest.mark.parametrize("row, message", [
    ({"problem": "<image><image>Find x.", "answer": "1", "images": ["a.png"]},
     "bad.jsonl:1: field 'problem': 2 '<image>' placeholders but 1 images"),
    ({"problem": "Find x.", "answer": "1", "images": ["missing.png"]}, "bad.jsonl:1: field 'images' [0]: image not found"),
    ({"problem": "Find x.", "images": ["a.png"]}, "bad.jsonl:1: field 'answer': missing or empty"),
])
def test_bad_rows_are_one_line_naming_file_row_and_field(tmp_path, preprocess, capsys, row, message):
    src = tmp_path / "bad.jsonl"
    src.write_text(json.dumps(row) + "\n")
    assert preprocess.main(["--input", str(src), "--split", "train", "--out-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


@pytest.mark.parametrize("name", ["geo3k/geo3k-qwen2.5-vl-3b.yaml", "squares/config.yaml"])
def test_example_configs_load(name):
    from tidal.config import load_config

    cfg = load_config(str(SCRIPT.parents[1] / name))
    assert cfg.engine.backend == "native" and cfg.data.train
