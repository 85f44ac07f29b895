#!/usr/bin/env bash
# GPU smoke of the whole pipeline: quickstart on CUDA (GRPO), then PPO with critic + KL + offloads.
# Usage (on the GPU machine, repo root): bash bench/gpu_smoke.sh OUTDIR
set -uo pipefail
OUT=${1:-/tmp/tidal_smoke}
mkdir -p "$OUT"
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -m tidal.cli train quickstart run.device=cuda run.steps=6 run.output_dir="$OUT/qs" eval.every=3 \
  task.workdir="$OUT/tasks" logging.backends=[jsonl] 2>&1 | tail -5
python3 -m tidal.cli train quickstart run.device=cuda run.steps=3 run.output_dir="$OUT/ppo" eval.every=0 eval.at_start=false \
  task.workdir="$OUT/tasks" logging.backends=[jsonl] algorithm.advantage=gae algorithm.kl_coef=0.05 \
  strategy.offload_optimizer=true strategy.offload_critic=true strategy.offload_actor_during_rollout=true engine.sleep_level=2 2>&1 | tail -5
python3 - "$OUT" <<'PY'
import json, sys
for run in ("qs", "ppo"):
    try:
        rows = [json.loads(l) for l in open(f"{sys.argv[1]}/{run}/metrics.jsonl")]
    except FileNotFoundError:
        print(json.dumps({"run": run, "error": "no metrics"})); continue
    last = rows[-1]
    keep = {k: v for k, v in last.items() if k.startswith(("time/", "memory/", "eval/", "reward/mean", "actor/loss", "mismatch/"))}
    print(json.dumps({"run": run, "steps": len(rows), **keep}))
PY
