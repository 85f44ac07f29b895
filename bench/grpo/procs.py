"""Worker subprocesses: each case runs in its own process (its peak memory is its own, a crash or a
hang ends only it), with a time limit, writing JSON records that the parent reads back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Callable

from bench.grpo.record import REPO

class Sink:
    """Append-only JSON-lines file, flushed per record (a killed worker leaves every finished record)."""

    def __init__(self, path: str):
        self.f = open(path, "a")

    def write(self, record: dict) -> None:
        self.f.write(json.dumps(record, default=str) + "\n")
        self.f.flush()


def read_records(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a line cut by a kill
    return out


def tail(path: str, n: int) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:]
    except OSError:
        return ""


class Spawner:
    """Starts workers for one run: spec and result files under ``work_dir``, the workers' output
    appended to ``out_dir/logs.txt`` and their records to ``raw`` (for ``out_dir/raw.jsonl``)."""

    def __init__(self, *, run_id: str, work_dir: str, device: str, out_dir: str | None):
        self.run_id, self.work_dir, self.device, self.out_dir = run_id, work_dir, device, out_dir
        self.raw: list[dict] = []

    def run(self, worker: str, spec: dict, timeout_s: float, tag: str) -> tuple[list[dict], int | None, str]:
        """Run ``worker`` to completion or ``timeout_s`` (then its process group is killed); returns
        its records, exit code (None when killed) and the end of its output."""
        base = os.path.join(self.work_dir, f"{tag}-{self.run_id}")
        spec = {**spec, "result_file": base + ".jsonl", "device": self.device, "work_dir": self.work_dir}
        json.dump(spec, open(base + ".spec.json", "w"))
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": os.pathsep.join(p for p in [REPO, os.environ.get("PYTHONPATH", "")] if p)}
        if self.device == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""
        rc = None
        with open(base + ".log", "w") as log:
            proc = subprocess.Popen([sys.executable, "-m", "bench.grpo", "worker", worker, base + ".spec.json"],
                                    stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
            try:
                rc = proc.wait(timeout=max(1.0, timeout_s))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()
        if self.out_dir:
            with open(os.path.join(self.out_dir, "logs.txt"), "a") as out, open(base + ".log") as src:
                out.write(f"===== {tag} =====\n{src.read()}\n")
        records = read_records(base + ".jsonl")
        self.raw.extend({"case": tag, **r} for r in records)
        return records, rc, tail(base + ".log", 1500)

    def write_raw(self) -> None:
        if self.out_dir:
            with open(os.path.join(self.out_dir, "raw.jsonl"), "a") as f:
                for rec in self.raw:
                    f.write(json.dumps({"run_id": self.run_id, **rec}, default=str) + "\n")


def run_worker(fn: Callable[[dict, Sink], None], spec_path: str) -> int:
    """Entry of a worker subprocess: read its spec, run ``fn(spec, sink)`` with a sink on the spec's
    result file; an exception becomes an ``error`` record (the parent reports it)."""
    spec = json.load(open(spec_path))
    sink = Sink(spec["result_file"])
    try:
        fn(spec, sink)
    except BaseException as e:
        import traceback

        sink.write({"kind": "error", "message": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]})
        return 1
    return 0


def first_error(records: list[dict]) -> str | None:
    """The first error's message and the end of its traceback (the whole one is in raw.jsonl)."""
    err = next((r for r in records if r["kind"] == "error"), None)
    if err is None:
        return None
    return err["message"] + ("\n..." + err["traceback"][-900:] if err.get("traceback") else "")


def version_of(name: str) -> str | None:
    try:
        import importlib.metadata as md

        return md.version(name)
    except Exception:
        return None
