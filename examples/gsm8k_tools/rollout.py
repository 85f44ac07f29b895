"""Multi-turn GSM8K / MATH rollouts with a sandboxed Python tool, scored by the math_answer rule.

Runs a local Hugging Face checkpoint through Tidal's environment path (the ``python``
environment, :mod:`tidal.envs.python_tool`) and writes every trajectory (the conversation, its
tokens' layout and its reward) as JSON lines. No training: this is the rollout half of the run
described in examples/gsm8k_tools/README.md, usable before the trainer is wired to environments.

    python examples/gsm8k_tools/rollout.py --model /models/Qwen2.5-1.5B-Instruct \\
        --data data/gsm8k/test.jsonl --rows 64 --n 4 --out runs/gsm8k_tools/trajectories.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="local Hugging Face model folder (tokenizer with a Qwen2.5/Qwen3 chat template)")
    p.add_argument("--data", required=True, help="prompt rows (JSONL with chat 'messages', e.g. from examples/gsm8k/preprocess.py)")
    p.add_argument("--rows", type=int, default=32, help="how many rows to roll out")
    p.add_argument("--n", type=int, default=4, help="trajectories per row")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-tokens-per-turn", type=int, default=512)
    p.add_argument("--max-turns", type=int, default=4)
    p.add_argument("--max-total-tokens", type=int, default=2048)
    p.add_argument("--engine", choices=["native", "hf"], default="native")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--kv-cache-max-tokens", type=int, default=0, help="native engine KV budget (0: from memory; required on CPU)")
    p.add_argument("--network", choices=["isolate", "allow"], default="isolate", help="env.sandbox.network")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/gsm8k_tools/trajectories.jsonl")
    return p.parse_args(argv)


def build_engine(args, hf_config, model):
    from tidal.dtypes import resolve_dtype
    from tidal.engine.config import EngineConfig
    from tidal.engine.factory import create_engine

    paged = {"kv_cache_max_tokens": args.kv_cache_max_tokens, "cuda_graphs": args.device.startswith("cuda")} if args.engine == "native" else {}
    cfg = EngineConfig(backend=args.engine, **paged)
    device = torch.device(args.device)
    engine = create_engine(hf_config, cfg, device=device, dtype=resolve_dtype(cfg.dtype, device))
    engine.load_weights(model.named_parameters())
    return engine


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from tidal.data.config import DataConfig, DataSource
    from tidal.data.dataset import PromptDataset
    from tidal.engine.base import SamplingParams
    from tidal.envs import EnvConfig, EnvRollout, EnvRow, SandboxConfig
    from tidal.rewards import RewardConfig, RewardEngine

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    hf_config = AutoConfig.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    engine = build_engine(args, hf_config, model)
    del model
    data = PromptDataset([DataSource(path=args.data)], tokenizer, DataConfig(max_prompt_len=4096), seed=args.seed)
    rows = [EnvRow.from_prompt_item(data[i]) for i in range(min(args.rows, len(data)))]
    env = EnvConfig(name="python", max_turns=args.max_turns, max_tokens_per_turn=args.max_tokens_per_turn,
                    max_total_tokens=args.max_total_tokens, sandbox=SandboxConfig(network=args.network))
    params = SamplingParams(temperature=args.temperature, max_new_tokens=args.max_tokens_per_turn, n=args.n, seed=args.seed)
    result = EnvRollout(env, tokenizer).run(engine.generate, rows, params)

    labels = sorted({r.label for r in rows if r.label} | {"default"})  # every label scores the final answer
    rewards = RewardEngine(RewardConfig(components={"correct": {"type": "math_answer"}},
                                        recipes={label: [["correct", 1.0]] for label in labels}), device=torch.device("cpu"))
    scored = [t for t in result.trajectories if t.turns]
    totals = rewards.score([t.reward_sample(i) for i, t in enumerate(scored)]).total_B.tolist() if scored else []
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as f:
        for t, r in zip(scored, totals):
            f.write(json.dumps({"row": t.row.where, "reward": r, "finish_reason": t.finish_reason, "valid": t.valid,
                                "turns": len(t.turns), "sampled_tokens": t.num_sampled_tokens, "messages": t.messages}) + "\n")
    accuracy = sum(totals) / max(len(result.trajectories), 1)
    print(json.dumps({"trajectories": len(result.trajectories), "accuracy": accuracy, **result.metrics}, indent=1))
    print(f"wrote {len(scored)} trajectories to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
