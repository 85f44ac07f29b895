"""One benchmark run in the parent process: its deadline, the setup worker (environment, model
folders, prompts, ceilings), one worker subprocess per (case, framework), bounds of a case from
its lengths, and the figures' record. The parent imports neither torch nor the frameworks."""

from __future__ import annotations

import dataclasses
import os
import statistics
import tempfile
import time

from bench.grpo.bounds import Ceilings, phase_bounds
from bench.grpo.procs import Spawner
from bench.grpo.record import Recorder
from bench.grpo.settings import RunSettings
from bench.grpo.shapes import kv_bytes_per_token
from bench.grpo.tidal_runner import summarize_tidal
from bench.grpo.trl_runner import summarize_trl
from bench.grpo.workloads import Workload

SUMMARIZE = {"tidal": summarize_tidal, "trl": summarize_trl}


class Session:
    """``args`` needs ``device``, ``work_dir``, ``out_dir``, ``time_budget_s``, ``tidal_set``,
    ``commit``; ``record_path``: where the figures go (None: printed only)."""

    def __init__(self, args, settings: RunSettings, *, record_path: str | None, work_dir_name: str):
        self.args = args
        self.settings = settings
        self.t_start = time.time()
        self.deadline = self.t_start + args.time_budget_s
        self.recorder = Recorder(commit=args.commit, record_path=record_path,
                                 settings={**dataclasses.asdict(settings), "tidal_set": list(args.tidal_set)})
        self.work_dir = args.work_dir or os.path.join(tempfile.gettempdir(), work_dir_name)
        os.makedirs(self.work_dir, exist_ok=True)
        if args.out_dir:
            os.makedirs(args.out_dir, exist_ok=True)
        self.spawner = Spawner(run_id=self.recorder.run_id, work_dir=self.work_dir, device=args.device, out_dir=args.out_dir)
        self.env: dict = {}
        self.models: dict[str, dict] = {}
        self.prompts: dict[tuple, str] = {}
        self.ceilings: Ceilings | None = None

    def emit(self, figure: str, **fields) -> dict:
        return self.recorder.emit(figure, **fields)

    def remaining(self) -> float:
        return self.deadline - time.time()

    # ---- setup -----------------------------------------------------------------------------------
    def setup(self, workloads: list[Workload], *, emit=None) -> bool:
        """Model folders and prompts for ``workloads``, ceilings on CUDA; figures env, model,
        ceilings through ``emit`` (default: recorded); an ``error`` figure and False on failure."""
        emit = emit or self.emit
        teachers = list(dict.fromkeys(w.teacher for w in workloads if w.teacher))
        sizes = list(dict.fromkeys([w.size for w in workloads] + teachers))
        prompt_sets = list(dict.fromkeys((w.size, w.prompt_len, w.prompts) for w in workloads))
        records, rc, tail = self.spawner.run("setup", {"sizes": sizes, "teachers": teachers, "prompt_sets": prompt_sets},
                                             self.remaining(), "setup")
        for r in records:
            if r["kind"] == "env":
                self.env = {k: v for k, v in r.items() if k != "kind"}
                self.recorder.device = self.env["device"]
                emit("env", commit=self.args.commit, **self.env, settings=self.recorder.settings,
                     time_budget_s=self.args.time_budget_s)
            elif r["kind"] == "model":
                self.models[r["size"]] = r
                emit("model", size=r["size"], params=r["params"], params_formula=r["params_formula"],
                     kv_bytes_per_token=kv_bytes_per_token(r["shape"]))
            elif r["kind"] == "prompts":
                self.prompts[(r["size"], r["prompt_len"], r["prompts_per_step"])] = r["path"]
            elif r["kind"] == "ceilings":
                self.ceilings = Ceilings(copy_bw=r["copy_bw"], matmul_flops=r["matmul_flops"])
                emit("ceilings", copy_bw_GBps=r["copy_bw"] / 1e9, bf16_matmul_TFLOPs=r["matmul_flops"] / 1e12)
        errors = [r for r in records if r["kind"] == "error"]
        if errors or rc != 0 or len(self.models) != len(sizes) or len(self.prompts) != len(prompt_sets):
            emit("error", stage="setup", rc=rc, message=errors[0]["message"] if errors else "setup did not finish",
                      log_tail=tail)
            return False
        return True

    # ---- workers ---------------------------------------------------------------------------------
    def run_case(self, framework: str, w: Workload, *, budget_s: float, tag: str, tidal_set: list[str],
                 profile: dict | None = None) -> tuple[dict, str]:
        """Run one framework on ``w`` within ``budget_s`` seconds; returns its summary (with ``rc``)
        and the end of its output."""
        model = self.models[w.size]
        spec = {"framework": framework, "workload": dataclasses.asdict(w), "settings": dataclasses.asdict(self.settings),
                "model_dir": model["model_dir"], "tokenizer_dir": model["tokenizer_dir"],
                "data": self.prompts[(w.size, w.prompt_len, w.prompts)],
                "run_dir": os.path.join(self.work_dir, f"run-{tag}-{self.recorder.run_id}"),
                "deadline": time.time() + budget_s - 10, "tidal_set": tidal_set,
                "teacher_dir": self.models[w.teacher]["teacher_dir"] if w.teacher else None}
        if profile:
            spec["profile"] = profile
        records, rc, tail = self.spawner.run(framework, spec, budget_s, tag)
        summary = SUMMARIZE[framework](records, w, self.settings)
        summary["rc"] = rc
        return summary, tail

    def bounds_per_step(self, w: Workload, lengths_per_step: list[list[int]], *, old_logprobs: bool,
                        experts_touched_per_step: list[float | None] | None = None) -> list[dict]:
        """Each steady iteration's phase bounds from its own completion lengths ([] without ceilings)
        and, for an MoE, the experts its decode steps touched; a distillation case's include its
        teacher's forward."""
        if self.ceilings is None:
            return []
        shape = self.models[w.size]["shape"]
        teacher_shape = self.models[w.teacher]["shape"] if w.teacher else None
        touched = experts_touched_per_step or [None] * len(lengths_per_step)
        return [phase_bounds(shape, prompt_len=w.prompt_len, unique_prompts=w.prompts, completion_lens=lens,
                             c=self.ceilings, old_logprobs=old_logprobs, kl=w.kl, teacher_shape=teacher_shape,
                             experts_touched=t)
                for lens, t in zip(lengths_per_step, touched)]

    def finish(self) -> None:
        self.recorder.write()
        self.spawner.write_raw()


def median_or_none(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def median_bounds(per_step: list[dict]) -> dict[str, float]:
    """The median over iterations of each phase's bound."""
    names = sorted({k for b in per_step for k in b})
    return {k: statistics.median([b[k] for b in per_step if k in b]) for k in names}
