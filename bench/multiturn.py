"""Multi-turn rollout benchmark on one GPU (issue 24, item 7): Tidal GRPO iterations whose rollouts
are multi-turn trajectories against a synthetic tool of fixed latency, against single-turn
iterations that sample the same number of tokens.

Model, prompts and tokenizer are bench/e2e_grpo.py's (a random-initialised Qwen2-0.5B-shaped model,
bf16 on disk; prompts of ``prompt_len`` random words; a WordLevel tokenizer), built once under
``--work-dir``. Every iteration: ``prompts x samples`` trajectories; a multi-turn trajectory has
``turns`` model turns of ``new_tokens / turns`` sampled tokens each (EOS ignored) and, between two
turns, one call of the synthetic tool (:class:`SyntheticToolEnv`): it sleeps ``tool_latency_ms``
and returns ``observation_tokens`` token ids. The single-turn baseline of the same case samples
``new_tokens`` in one turn (``env.name: single_turn``). ``env.workers`` equals the number of
trajectories, so the tools of one round all wait at once.

Figures (one JSON line per case on stdout, appended with ``--out``) carry the workload matrix's
keys (``figure: case``, ``case``, ``size``, ``seqs``, ``prompt_len``, ``max_new_tokens``,
``lengths: forced``, ``iteration_s``, ``phases``, ``turns``, ``tool_latency_ms``, ``error``; a
single-turn case has ``turns: 1``, ``tool_latency_ms: 0``), so they can be appended to
bench/results/matrix.jsonl, and this benchmark's own: median seconds per rollout (``generate_s``,
``time/generate``) over the timed iterations; ``wait_s``, the rollout time during which nothing
was decoded because every unfinished trajectory waited for its tool (``env/wait_s``);
``gpu_idle_frac = wait_s / generate_s``, the issue's "fraction of time the GPU idles while waiting
for tools" (target below 0.1 at 50 ms); ``engine_calls`` per rollout; ``vs_single_turn``, the
iteration time over the single-turn case's with the same sampled tokens.

The rollout loop (tidal/envs/rollout.py): on the native engine it is continuous, each
trajectory's next turn is added to the running batch (the engine's ``add``/``step``) the moment
its tool answers, so decoding overlaps the tool waits and ``wait_s`` is only the time where every
unfinished trajectory waits for its tool; ``engine_calls`` then counts ``add`` calls. Engines
without incremental requests decode in rounds of batch ``generate`` calls (a round's decode and
its tools' waits do not overlap): measured that way at commit 38a90a1 on an H200 (4 turns, 50 ms):
``gpu_idle_frac`` 0.24, ``vs_single_turn`` 1.54.

Tool latencies relative to the engine (issue 40, item 5): ``--latency-steps 5,20,100`` gives each
multi-turn case a fixed latency of that many times the median engine step, measured in the
single-turn baseline case of the same shape (``step_ms``: the median wall time of one engine
``step`` there); ``--lognormal-steps 20`` adds a heavy-tailed case: each tool call sleeps a
lognormal latency of median 20 steps and p99 about 10x the median (sigma = ln 10 / 2.326), drawn
from the row and the turn (the same draws in every run). Such a figure also reports
``engine_idle_frac``, the share of the rollout's wall time spent outside engine steps (waiting for
tools, and the loop's host work between steps; from the medians over the timed rollouts, and
``engine_idle_frac_total`` from their sums), ``wait_frac`` (``env/wait_s`` over the rollout
time, the same as ``gpu_idle_frac``), ``trajectories_per_s`` (trajectories over the rollout's
seconds), ``step_ms`` and ``latency_steps``.

``--inflight`` (issue 47, item 1) runs every multi-turn case a second time right after the first,
with trajectories in flight across rollouts (``rollout.partial.mode: carry``, ``max_staleness`` 4,
``algorithm.mismatch.mode: token_truncate``, ``env.workers`` raised to the most trajectories in
flight): its figure (``-inflight``) adds ``trajectories_per_s_vs_off`` and ``engine_idle_frac_off``
(the case just before, without), and the lag of the trained tokens (``partial_staleness_mean`` /
``_max``, ``partial_stale_token_frac``, ``partial_span_mean``) with the groups carried and started
per rollout. On a loaded machine compare an in-flight figure with the one just before it only.

Usage (GPU):
    python bench/multiturn.py [--turns 4] [--latency-ms 0,50,200] [--steps 3] [--out bench/results/matrix.jsonl]
    python bench/multiturn.py --latency-steps 5,20,100 --lognormal-steps 20
    python bench/multiturn.py --tiny    # CPU smoke run: tiny model, 2 prompts x 2, 2 turns of 4 tokens
    python bench/multiturn.py --cpu --latency-steps 5,20,100 --lognormal-steps 20 --out bench/results/multiturn.jsonl
                                        # CPU run: tiny model, 16 prompts x 4 = 64 trajectories, 4 turns
A matrix runner calls :func:`run_case` with a case's config (:func:`case_config`) and its :class:`Case`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for path in (ROOT, HERE):  # tidal, and bench/e2e_grpo.py's asset builders
    if path not in sys.path:
        sys.path.insert(0, path)

from bench.grpo.record import git_commit  # noqa: E402
from tidal.envs import Environment, Observation, StepResult  # noqa: E402

ENV_PATH = "multiturn:SyntheticToolEnv"  # bench/ is on sys.path (as e2e_grpo's reward is)
TINY_SHAPE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                  vocab_size=512)


LOGNORMAL_SIGMA = math.log(10.0) / 2.3263  # p99 / median = exp(2.3263 sigma) = 10


class SyntheticToolEnv(Environment):
    """``turns`` model turns; between two of them a tool call that sleeps ``latency_ms`` (with
    ``sigma > 0``: a lognormal latency of median ``latency_ms`` and log-scale ``sigma``, drawn from
    the row's prompt and the turn) and answers ``observation_tokens`` copies of token
    ``observation_id``. The prompt is the row's ids."""

    counter_names = ("tool_calls",)

    def __init__(self, cfg, *, turns: int, latency_ms: float, observation_tokens: int, observation_id: int,
                 sigma: float = 0.0):
        super().__init__(cfg)
        self.turns, self.latency_s, self.sigma = int(turns), float(latency_ms) / 1e3, float(sigma)
        self.observation = [int(observation_id)] * int(observation_tokens)
        self.prompt: tuple[int, ...] = ()

    def reset(self, row):
        self.prompt = tuple(row.prompt_ids)
        return Observation(token_ids=list(row.prompt_ids))

    def latency(self, turn_index: int) -> float:
        """Seconds the tool call after turn ``turn_index`` sleeps."""
        if self.sigma <= 0:
            return self.latency_s
        rng = random.Random(hash((self.prompt, turn_index)))  # ints and tuples of ints hash alike in every run
        return self.latency_s * math.exp(self.sigma * rng.gauss(0.0, 1.0))

    def step(self, turn):
        if turn.index + 1 >= self.turns:
            return StepResult(done=True, counters={"tool_calls": 0.0})
        time.sleep(self.latency(turn.index))
        return StepResult(observation=Observation(token_ids=self.observation), counters={"tool_calls": 1.0})


@dataclasses.dataclass(kw_only=True)
class Case:
    """One benchmark case. ``turns == 1`` is the single-turn baseline (no tool)."""

    turns: int
    tool_latency_ms: float  # the median with lognormal latencies
    latency_sigma: float = 0.0  # lognormal log-scale (0: a fixed latency)
    latency_steps: float | None = None  # tool_latency_ms in median engine steps (when given that way)
    prompts: int = 16
    samples: int = 8
    prompt_len: int = 128
    new_tokens: int = 256  # sampled per trajectory, over all its turns
    observation_tokens: int = 16
    size: str = "0.5b"  # "tiny" on the CPU smoke run
    warmup: int = 1
    steps: int = 3
    seed: int = 1
    inflight: bool = False  # rollout.partial.mode=carry: trajectories in flight across rollouts
    max_staleness: int = 4


def case_config(case: Case, *, model_dir: str, tokenizer_dir: str, data: str, vocab_size: int, device: str,
                run_dir: str) -> dict:
    """The Tidal run config of a case."""
    per_turn = case.new_tokens // case.turns
    seqs = case.prompts * case.samples
    context = case.prompt_len + case.new_tokens + (case.turns - 1) * case.observation_tokens
    kv_tokens = 1 << (seqs * (context + 16) - 1).bit_length()
    env = {"name": "single_turn"}
    # in flight: up to prompts * (max_staleness + 2) groups (tidal.trainer.partial.max_in_flight), each tool its own worker
    in_flight = seqs * (case.max_staleness + 2) if case.inflight else seqs
    if case.turns > 1:
        env = {"name": ENV_PATH, "max_turns": case.turns, "max_tokens_per_turn": per_turn, "workers": in_flight,
               "kwargs": {"turns": case.turns, "latency_ms": case.tool_latency_ms, "observation_tokens": case.observation_tokens,
                          "observation_id": 1, "sigma": case.latency_sigma}}
    rollout = {"prompts_per_step": case.prompts, "n_samples": case.samples, "max_new_tokens": per_turn * case.turns,
               "ignore_eos": True, "temperature": 1.0}
    algorithm = {"advantage": "grpo", "policy_loss": "ppo_clip", "loss_agg": "token_mean"}
    if case.inflight:
        rollout["partial"] = {"mode": "carry", "max_staleness": case.max_staleness}
        algorithm["mismatch"] = {"mode": "token_truncate"}
    return {
        "run": {"output_dir": run_dir, "steps": case.warmup + case.steps, "seed": case.seed, "device": device},
        "model": {"path": model_dir, "tokenizer_path": tokenizer_dir},
        "data": {"train": [{"path": data}], "apply_chat_template": False, "max_prompt_len": case.prompt_len},
        "rollout": rollout,
        "env": env,
        "engine": {"kv_cache_max_tokens": kv_tokens},
        "optim": {"lr": 1e-6, "max_grad_norm": 1.0},
        "algorithm": algorithm,
        "reward": {"components": {"score": {"type": "function", "path": "e2e_grpo:tidal_reward"}},
                   "recipes": {"default": [["score", 1.0]]}, "default_recipe": "default"},
        "eval": {"at_start": False, "at_end": False, "every": 0},
        "checkpoint": {"every": 0, "at_end": False, "resume": "never"},
        "logging": {"backends": []},
    }


def run_case(config: dict, case: Case) -> dict:
    """Build the trainer of ``config`` and time its iterations; returns the case's figure."""
    from tidal.build import build_trainer
    from tidal.config import TidalConfig
    from tidal.config_base import build

    trainer = build_trainer(build(TidalConfig, config))
    step_s = _time_engine_steps(trainer.colocation.engine)
    steps, timed_steps, step_time = [], [], []
    for step in range(1, case.warmup + case.steps + 1):
        step_s.clear()
        m = trainer.train_step(step)
        if step > case.warmup:
            steps.append(m)
            timed_steps += step_s
            step_time.append(sum(step_s))

    def med(key):
        values = [m[key] for m in steps if key in m]
        return statistics.median(values) if values else None

    generate_s, wait_s = med("time/generate"), med("env/wait_s") or 0.0
    seqs = case.prompts * case.samples
    latency = case.tool_latency_ms if case.turns > 1 else 0.0
    phases = {k[len("time/"):]: med(k) for k in sorted({k for m in steps for k in m}) if k.startswith("time/") and k != "time/step"}
    in_steps = statistics.median(step_time) if step_time else None
    relative = {  # issue 40 item 5: the engine's share of the rollout, and the rate of trajectories
        "step_ms": statistics.median(timed_steps) * 1e3 if timed_steps else None, "engine_steps": len(timed_steps) / max(1, len(steps)),
        "engine_idle_frac": 1.0 - in_steps / generate_s if generate_s and in_steps is not None else None,
        # over all timed rollouts together (rollouts in flight alternate long and short: medians pair unlike ones)
        "engine_idle_frac_total": 1.0 - sum(step_time) / sum(m["time/generate"] for m in steps) if steps else None,
        "wait_frac": wait_s / generate_s if generate_s else None,
        "trajectories_per_s": seqs / generate_s if generate_s else None,
        "latency_dist": "lognormal" if case.latency_sigma > 0 else "fixed", "latency_sigma": case.latency_sigma,
        "latency_steps": case.latency_steps, "inflight": case.inflight,
    }
    if case.inflight:  # how far the trained tokens lag their weights, and the groups in flight
        relative.update({k.replace("partial/", "partial_"): med(k) for k in (
            "partial/staleness_mean", "partial/staleness_max", "partial/stale_token_frac", "partial/span_mean",
            "partial/carried_groups", "partial/new_groups", "partial/restarted")})
    return {  # the workload matrix's keys (bench/results/matrix.jsonl), then this benchmark's own
        "figure": "case", "case": f"{case.size}-{seqs}x{case.new_tokens}-forced-t{case.turns}-l{latency:.4g}"
        + (f"-s{case.latency_steps:g}" if case.latency_steps is not None else "") + ("-lognormal" if case.latency_sigma else "")
        + ("-inflight" if case.inflight else ""), "size": case.size,
        "seqs": seqs, "prompts": case.prompts, "samples": case.samples, "prompt_len": case.prompt_len,
        "max_new_tokens": case.new_tokens, "lengths": "forced", "partial_rollout": False, "kl": False,
        "iteration_s": med("time/step"), "phases": phases, "turns": case.turns, "tool_latency_ms": latency,
        "observation_tokens": case.observation_tokens if case.turns > 1 else 0, "iterations": len(steps),
        "generate_s": generate_s, "wait_s": wait_s, "gpu_idle_frac": wait_s / generate_s if generate_s else None,
        "engine_calls": med("env/generate_calls"), "turns_mean": med("env/turns_mean"),
        "sampled_tokens_mean": med("response/length_mean"), **relative, "error": None,
    }


def _time_engine_steps(engine) -> list[float]:
    """Record the wall seconds of every ``engine.step`` call (the list returned, appended to)."""
    seconds: list[float] = []
    step = engine.step

    def timed_step():
        t0 = time.perf_counter()
        try:
            return step()
        finally:
            seconds.append(time.perf_counter() - t0)

    engine.step = timed_step
    return seconds


def _assets(work_dir: str, tiny: bool, prompt_len: int, device: str) -> dict:
    import e2e_grpo

    shape = TINY_SHAPE if tiny else e2e_grpo.SHAPES["0.5b"]
    model_dir = os.path.join(work_dir, "model-tiny" if tiny else "model-0.5b")
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        e2e_grpo.build_model_dir(model_dir, shape, device)
    tok_dir = os.path.join(work_dir, f"tokenizer-{shape['vocab_size']}")
    if not os.path.exists(os.path.join(tok_dir, "config.json")):
        e2e_grpo.build_tokenizer(shape["vocab_size"]).save_pretrained(tok_dir)
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast"}, open(os.path.join(tok_dir, "config.json"), "w"))
    data = os.path.join(work_dir, f"prompts-{prompt_len}.jsonl")
    e2e_grpo.write_prompts(data, rows=256, prompt_len=prompt_len, vocab_size=shape["vocab_size"])
    return {"model_dir": model_dir, "tokenizer_dir": tok_dir, "data": data, "vocab_size": shape["vocab_size"]}


def _worker(spec: dict) -> None:
    """One case in this process (a fresh process per case: its memory and engine are its own)."""
    import torch

    case = Case(**spec["case"])
    if spec["device"] == "cpu":
        torch.set_num_threads(1)
    config = case_config(case, device=spec["device"], run_dir=spec["run_dir"], **spec["assets"])
    print(json.dumps(run_case(config, case)), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--turns", default="4", help="comma-separated turn counts (each with its single-turn baseline)")
    p.add_argument("--latency-ms", default="0,50,200", help="comma-separated tool latencies")
    p.add_argument("--steps", type=int, default=3, help="timed iterations per case (after one warm-up)")
    p.add_argument("--work-dir", default="/tmp/tidal_bench_multiturn")
    p.add_argument("--out", default="", help="append the figures to this JSONL file")
    p.add_argument("--latency-steps", default="", help="comma-separated tool latencies in median engine steps "
                   "(measured in the single-turn case), instead of --latency-ms")
    p.add_argument("--lognormal-steps", type=float, default=0.0,
                   help="add a case of lognormal tool latencies of this median (in engine steps), p99 10x the median")
    p.add_argument("--inflight", action="store_true", help="run every multi-turn case twice, back to back: as is, then "
                   "with trajectories in flight across rollouts (rollout.partial.mode=carry); the second carries its "
                   "ratios to the first (trajectories_per_s_vs_off, engine_idle_frac_off)")
    p.add_argument("--tiny", action="store_true", help="CPU smoke run with a tiny model")
    p.add_argument("--cpu", action="store_true", help="CPU run with the tiny model: 16 prompts x 4, 4 turns of 16 tokens")
    p.add_argument("--before", default="", help="a source tree of an earlier commit (its commit hash in DIR/COMMIT): "
                   "every multi-turn case runs there first, with that tree's code (the figure stamped with its commit)")
    p.add_argument("--note", default="", help="a note stamped on every figure (e.g. the machine's load)")
    p.add_argument("--worker", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _worker(json.loads(args.worker))
        return 0
    import torch

    tiny = args.tiny or args.cpu
    device = "cuda" if torch.cuda.is_available() and not tiny else "cpu"
    sizes = {"steps": args.steps}
    if args.tiny:
        sizes = dict(prompts=2, samples=2, prompt_len=8, new_tokens=8, observation_tokens=2, steps=1, size="tiny")
    elif args.cpu:
        sizes = dict(prompts=16, samples=4, prompt_len=16, new_tokens=64, observation_tokens=4, steps=args.steps, size="tiny")
    os.makedirs(args.work_dir, exist_ok=True)
    assets = _assets(args.work_dir, tiny, sizes.get("prompt_len", 128), device)
    meta = {"commit": git_commit(), "device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "bench": "multiturn"}
    failed = 0
    for turns in [int(t) for t in args.turns.split(",")]:
        turns = 2 if args.tiny else turns
        baseline = _record(Case(turns=1, tool_latency_ms=0.0, **sizes), device, assets, args, meta, None)
        failed += baseline.get("error") is not None
        if args.latency_steps or args.lognormal_steps:  # in median engine steps of the baseline
            step_ms = baseline.get("step_ms")
            if not step_ms:
                return 1
            cases = [Case(turns=turns, tool_latency_ms=float(k) * step_ms, latency_steps=float(k), **sizes)
                     for k in args.latency_steps.split(",") if k]
            if args.lognormal_steps:
                cases.append(Case(turns=turns, tool_latency_ms=args.lognormal_steps * step_ms, latency_sigma=LOGNORMAL_SIGMA,
                                  latency_steps=args.lognormal_steps, **sizes))
        else:
            cases = [Case(turns=turns, tool_latency_ms=float(ms), **sizes) for ms in args.latency_ms.split(",")]
        for case in cases:
            if args.before:
                before_meta = dict(meta, commit=open(os.path.join(args.before, "COMMIT")).read().strip())
                script = os.path.join(args.before, "bench", "multiturn.py")
                failed += _record(case, device, assets, args, before_meta, baseline, script=script).get("error") is not None
            off = _record(case, device, assets, args, meta, baseline)
            failed += off.get("error") is not None
            if args.inflight:
                failed += _record(dataclasses.replace(case, inflight=True), device, assets, args, meta, baseline,
                                  off=off).get("error") is not None
    return 1 if failed else 0


def _record(case: Case, device: str, assets: dict, args, meta: dict, baseline: dict | None, off: dict | None = None,
            script: str | None = None) -> dict:
    """Run ``case`` in a fresh process; print (and append to ``--out``) its figure, with
    ``vs_single_turn`` against ``baseline`` and, for an in-flight case, ``trajectories_per_s_vs_off``
    and ``engine_idle_frac_off`` against ``off`` (the same case run just before without). ``script``:
    another tree's bench/multiturn.py to run it with (the case's fields that tree knows). Returns the figure."""
    name = f"run-{case.turns}-{case.tool_latency_ms:g}" + ("-lognormal" if case.latency_sigma else "") + ("-inflight" if case.inflight else "")
    fields = dataclasses.asdict(case)
    if script is not None:  # an earlier tree: without the fields it may not know (their defaults)
        fields = {k: v for k, v in fields.items() if k not in ("inflight", "max_staleness")}
        name += "-before"
    spec = {"case": fields, "device": device, "assets": assets, "run_dir": os.path.join(args.work_dir, name)}
    proc = subprocess.run([sys.executable, script or os.path.abspath(__file__), "--worker", json.dumps(spec)],
                          capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(script))) if script else None)
    figures = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not figures:
        record = {"figure": "case", "turns": case.turns, "tool_latency_ms": case.tool_latency_ms,
                  "error": (proc.stderr or proc.stdout)[-2000:]}
    else:
        record = figures[-1]
        if case.turns > 1 and baseline and baseline.get("iteration_s"):
            record["vs_single_turn"] = record["iteration_s"] / baseline["iteration_s"]
        if off and off.get("trajectories_per_s") and record.get("trajectories_per_s"):
            record["trajectories_per_s_vs_off"] = record["trajectories_per_s"] / off["trajectories_per_s"]
            record["engine_idle_frac_off"] = off.get("engine_idle_frac")
    record.update(meta)
    if script is not None:
        record["tree"] = "before"
    if args.note:
        record["note"] = args.note
    record["command"] = "python bench/multiturn.py " + " ".join(sys.argv[1:])
    print(json.dumps(record), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(record) + "\n")
    return record


if __name__ == "__main__":
    sys.exit(main())
