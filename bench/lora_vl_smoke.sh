#!/usr/bin/env bash
# GPU smoke of LoRA and vision-language runs (issue 10): LoRA GRPO on the quickstart task with the
# native engine receiving merged weights, its export, and the squares VL task (HF engine), full and LoRA.
# Usage (on the GPU machine, repo root): bash bench/lora_vl_smoke.sh OUTDIR
set -uo pipefail
OUT=${1:-/tmp/tidal_lora_vl}
mkdir -p "$OUT"
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch, transformers, peft; print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"
QS=(run.device=cuda task.workdir="$OUT/tasks" logging.backends=[jsonl] run.steps=20 eval.every=10 checkpoint.every=20)
LORA=(model.lora.rank=16 model.lora.alpha=32 optim.lr=1e-3 algorithm.kl_coef=0.01)
time python3 -m tidal.cli train quickstart "${QS[@]}" run.output_dir="$OUT/qs_full" 2>&1 | grep "eval at"
time python3 -m tidal.cli train quickstart "${QS[@]}" "${LORA[@]}" run.output_dir="$OUT/qs_lora" 2>&1 | grep "eval at\|Error"
python3 -m tidal.cli export quickstart "${QS[@]}" "${LORA[@]}" run.output_dir="$OUT/qs_lora" \
  --checkpoint "$OUT/qs_lora/checkpoints/step_000020" --out "$OUT/qs_lora_export" 2>&1 | grep -i "error" ; ls "$OUT/qs_lora_export" "$OUT/qs_lora_export/adapter"
du -sh "$OUT/qs_lora/checkpoints/step_000020" "$OUT/qs_full/checkpoints/step_000020"
python3 -m tidal.tasks.squares "$OUT/sq" | tail -3
SQ=(run.device=cuda model.path="$OUT/sq/model" "data.train=[{path: $OUT/sq/train.jsonl}]" "data.eval=[{path: $OUT/sq/eval.jsonl}]")
time python3 -m tidal.cli train examples/squares/config.yaml "${SQ[@]}" run.output_dir="$OUT/sq_full" 2>&1 | grep "eval at\|Error"
time python3 -m tidal.cli train examples/squares/config.yaml "${SQ[@]}" run.output_dir="$OUT/sq_lora" run.steps=40 \
  model.lora.rank=8 model.lora.alpha=16 model.lora.target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj] \
  optim.lr=1e-2 algorithm.kl_coef=0.01 2>&1 | grep "eval at\|Error"
python3 - "$OUT" <<'PY'
import json, sys
for run in ("qs_full", "qs_lora", "sq_full", "sq_lora"):
    try:
        rows = [json.loads(l) for l in open(f"{sys.argv[1]}/{run}/metrics.jsonl")]
    except FileNotFoundError:
        print(json.dumps({"run": run, "error": "no metrics"})); continue
    r = [x["reward/mean"] for x in rows]
    last = rows[-1]
    keep = {k: round(v, 5) for k, v in last.items() if k.startswith(("time/step", "time/weight_sync", "time/generate", "time/train", "memory/", "eval/greedy_accuracy", "mismatch/abs", "kl/"))}
    print(json.dumps({"run": run, "steps": len(rows), "reward_first5": round(sum(r[:5]) / 5, 3), "reward_last5": round(sum(r[-5:]) / 5, 3), **keep}))
PY
