"""Turn local GSM8K files into Tidal prompt rows (JSONL).

Input: the public GSM8K files as local paths, either the Hugging Face parquet files
(``openai/gsm8k``: ``main/train-00000-of-00001.parquet``, ``main/test-00000-of-00001.parquet``) or
the original JSONL (``grade_school_math/data/train.jsonl``); each row has ``question`` and
``answer`` (a worked solution ending in ``#### <number>``).

Output, one JSON object per line::

    {"messages": [{"role": "user", "content": "<question>\\n\\n<instruction>"}],
     "reference": "72", "label": "gsm8k", "solution": "<the original answer text>", "index": 0}

A bad input row stops the script before anything is written, with one line naming the file, the
row (``file:line`` for JSONL, ``file row N`` for Parquet/JSON) and the field; exit code 2.
(``--style prompt`` writes ``"prompt": "<question>\\n\\n<instruction>"`` instead of ``messages``).
The instruction asks for the final answer after ``####`` (``--answer-format hash``, default) or in
``\\boxed{}`` (``--answer-format boxed``). ``reference`` is the number after ``####`` with thousands
separators removed. Usage::

    python examples/gsm8k/preprocess.py --input gsm8k/main/train-00000-of-00001.parquet --output data/gsm8k/train.jsonl
    python examples/gsm8k/preprocess.py --input gsm8k/main/test-00000-of-00001.parquet --output data/gsm8k/test.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

from tidal.data import DataSource
from tidal.data.loaders import load_rows

INSTRUCTIONS = {
    "hash": 'Let\'s think step by step and output the final answer after "####".',
    "boxed": "Please reason step by step, and put your final answer within \\boxed{}.",
}
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def reference_of(answer: str, where: str) -> str:
    """The number after the last ``####`` of a GSM8K answer (``"1,234"`` -> ``"1234"``)."""
    if "####" not in answer:
        raise ValueError(f"{where}: field 'answer': no '####' final-answer marker")
    ref = answer.rsplit("####", 1)[1].strip().replace(",", "")
    if not _NUMBER.fullmatch(ref):
        raise ValueError(f"{where}: field 'answer': final answer {ref!r} is not a number")
    return ref


def convert_row(where: str, row: dict, index: int, *, style: str, answer_format: str) -> dict:
    for key in ("question", "answer"):
        if not isinstance(row.get(key), str):
            got = "missing" if key not in row else f"a {type(row[key]).__name__}, not a string"
            raise ValueError(f"{where}: field '{key}': {got} (GSM8K rows have string 'question' and 'answer' fields)")
    text = f"{row['question'].strip()}\n\n{INSTRUCTIONS[answer_format]}"
    prompt = {"messages": [{"role": "user", "content": text}]} if style == "messages" else {"prompt": text}
    return {**prompt, "reference": reference_of(row["answer"], where), "label": "gsm8k", "solution": row["answer"], "index": index}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", nargs="+", required=True, help="GSM8K .parquet or .jsonl files (concatenated in order)")
    parser.add_argument("--output", type=Path, required=True, help="output .jsonl path")
    parser.add_argument("--style", choices=["messages", "prompt"], default="messages", help="chat messages (default) or a plain prompt string")
    parser.add_argument("--answer-format", choices=sorted(INSTRUCTIONS), default="hash", help="where the model is asked to put its final answer")
    args = parser.parse_args(argv)
    try:
        out = []
        for path in args.input:
            for where, row in load_rows(DataSource(path=path)):
                out.append(convert_row(where, row, len(out), style=args.style, answer_format=args.answer_format))
    except (ValueError, OSError) as e:  # bad input: one line naming the file, row and field; nothing written
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    args.output.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.output.with_name(args.output.name + ".tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in out), encoding="utf-8")
    os.replace(tmp, args.output)
    print(f"wrote {len(out)} rows to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
