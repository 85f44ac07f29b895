"""Turn local Geometry3K files into Tidal prompt rows with images (JSONL + PNG files).

Input: local copies of Geometry3K, either the Hugging Face parquet files (``hiyouga/geometry3k``:
``data/train-*.parquet``, ``data/validation-*.parquet``, ``data/test-*.parquet``; columns
``images`` (a list of ``{"bytes", "path"}`` image structs), ``problem`` (text with an ``<image>``
placeholder) and ``answer``) or JSONL/JSON with the same fields, where an image may also be a
file path (relative to the input file's folder).

Output: ``OUT_DIR/<split>.jsonl`` and the images as ``OUT_DIR/images/<split>/<index>-<k>.png``;
one JSON object per line::

    {"prompt": "<image>Find x. ...\\n\\n<instruction>", "images": ["images/train/00000-0.png"],
     "reference": "3", "label": "geo3k", "index": 0}

Image paths are relative to the JSONL file (Tidal resolves them against its folder). A problem
without an ``<image>`` placeholder gets its images before the text. The instruction asks for the
final answer in ``\\boxed{}``, which the ``math_answer`` reward rule reads. Usage::

    python examples/geo3k/preprocess.py --input /data/geometry3k/data/train-00000-of-00001.parquet --split train --out-dir data/geo3k
    python examples/geo3k/preprocess.py --input /data/geometry3k/data/test-00000-of-00001.parquet --split test --out-dir data/geo3k
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from tidal.data import DataSource
from tidal.data.loaders import load_rows
from tidal.data.vision import IMAGE_PLACEHOLDER, load_image

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


def convert_row(where: str, row: dict, index: int, *, split: str, out_dir: Path, base_dir: Path) -> dict:
    """One output row; writes the row's images as PNG files under ``out_dir/images/<split>``."""
    problem, answer, images = row.get("problem"), row.get("answer"), row.get("images")
    if not isinstance(problem, str) or not problem.strip():
        raise ValueError(f"{where}: field 'problem': must be a non-empty string, got {problem!r:.40}")
    if answer is None or (isinstance(answer, str) and not answer.strip()):
        raise ValueError(f"{where}: field 'answer': missing or empty")
    if images is None:
        images = []
    if not isinstance(images, list):
        images = [images]
    if not images:
        raise ValueError(f"{where}: field 'images': no image (Geometry3K problems have one)")
    marks = problem.count(IMAGE_PLACEHOLDER)
    if marks and marks != len(images):
        raise ValueError(f"{where}: field 'problem': {marks} '{IMAGE_PLACEHOLDER}' placeholders but {len(images)} images")
    img_dir = out_dir / "images" / split
    img_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for k, ref in enumerate(images):
        try:
            image = load_image(ref, base_dir)
        except (OSError, ValueError) as e:
            raise ValueError(f"{where}: field 'images' [{k}]: {e}") from None
        name = f"{index:05d}-{k}.png"
        image.save(img_dir / name)
        paths.append(f"images/{split}/{name}")
    text = problem.strip() if marks else IMAGE_PLACEHOLDER * len(images) + problem.strip()
    return {"prompt": f"{text}\n\n{INSTRUCTION}", "images": paths, "reference": str(answer).strip(), "label": "geo3k", "index": index}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", nargs="+", required=True, help="Geometry3K .parquet/.jsonl/.json files (concatenated in order)")
    parser.add_argument("--split", required=True, help="name of the output split (train, validation, test)")
    parser.add_argument("--out-dir", type=Path, required=True, help="folder for <split>.jsonl and images/<split>/")
    args = parser.parse_args(argv)
    try:
        out = []
        for path in args.input:
            base = Path(path).resolve().parent
            for where, row in load_rows(DataSource(path=path)):
                out.append(convert_row(where, row, len(out), split=args.split, out_dir=args.out_dir, base_dir=base))
    except (ValueError, OSError) as e:  # bad input: one line naming the file, row and field
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    target = args.out_dir / f"{args.split}.jsonl"
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in out), encoding="utf-8")
    os.replace(tmp, target)
    print(f"wrote {len(out)} rows to {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
