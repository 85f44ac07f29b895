"""The memory plan against the GPU (issue 21): predicted and measured peak memory, per phase.

One case per command: a random-initialised Qwen2.5-shaped model (``--size``: 0.5b, 1.5b, 3b, 7b;
``--lora R`` for rank-R adapters) trains with GRPO on ``--sequences`` forced-length sequences
(``--prompt-len`` random prompt tokens, ``--new-tokens`` generated) with every memory setting left at
``auto``, so the plan alone decides; ``--set key=value`` adds config overrides. It prints (and
appends to ``--record``) one JSON line per iteration and a summary:

- ``predicted_peak_gib``: the plan's largest ``torch.cuda.max_memory_allocated`` of any phase, and
  per plan phase its predicted allocated GiB;
- ``measured_peak_gib``: ``torch.cuda.max_memory_allocated`` over the iteration's phases, and per plan phase
  the largest peak of the trainer phases it stands for (rollout: engine wake/generate/sleep;
  experience: actor/reference logprobs, critic values; update and optimizer step: train; weight
  sync) -- the native engine's KV cache is outside the allocator in both;
- ``ratio`` = measured / predicted (the plan aims within 10%), the host's peak resident memory
  (``ru_maxrss``) against the plan's host figure.

The plan is the one the run makes: :func:`tidal.memory.probe.make_plan` is called on the
same config before ``build_trainer`` (before anything is allocated on the device, so the CUDA
context is measured alone), and the summary says whether the run resolved its settings to the same
choice (``same_choice``). This is also how any benchmark records ``predicted_peak_gib``.

Model folders are built once under ``--workdir`` (a 7B one takes 15 GB of disk). ``--tiny`` runs a
tiny model on CPU with the plan made for a device of ``--device-gib`` (``memory.device_memory_gib``)
to check the script itself. Self-contained: it imports only ``tidal`` and its dependencies.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import time

from bench.grpo.record import git_commit
from tidal.logging import PhaseObserver

HERE = os.path.dirname(os.path.abspath(__file__))
# this module as the reward's ``module:function`` path (run as a script, bench/ is on sys.path)
MODULE = __name__ if __name__ != "__main__" else "memory_check"

SHAPES = {  # config.json of the public Qwen2.5 checkpoints
    "0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, intermediate_size=4864,
                 vocab_size=151936, tie_word_embeddings=True),
    "1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, intermediate_size=8960,
                 vocab_size=151936, tie_word_embeddings=True),
    "3b": dict(hidden_size=2048, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2, intermediate_size=11008,
               vocab_size=151936, tie_word_embeddings=True),
    "7b": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, intermediate_size=18944,
               vocab_size=152064, tie_word_embeddings=False),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                 vocab_size=1024, tie_word_embeddings=True),
}
# trainer phases (timer names) each plan phase stands for
PHASE_MAP = {
    "rollout": ("engine_wake", "generate", "engine_sleep"),
    "experience": ("actor_logprobs", "reference_logprobs", "critic_values"),
    "update": ("train",),
    "optimizer step": ("train",),
    "critic update": ("train",),
    "weight sync": ("weight_sync",),
}
GIB = 2**30


def build_model_dir(path: str, shape: dict, device: str) -> None:
    """A random-initialised Qwen2 model saved in bf16 (built on ``device``, once), with a small
    byte-level BPE tokenizer in the same folder (Qwen2's layout: every digit one token; its ids are a
    prefix of the model's vocabulary)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tidal.tasks.tokenizer import save_tokenizer, train_tokenizer

    if os.path.exists(os.path.join(path, "config.json")):
        return
    tok = train_tokenizer(["0123456789 memory check"] * 8)
    cfg = Qwen2Config(**shape, max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path)
    save_tokenizer(tok, path)
    del model


def score_reward(samples) -> list[float]:
    """A deterministic score in [0, 1) of each response's token ids (varies within a group, costs nothing)."""
    return [(sum(int(t) for t in s.response_ids) % 997) / 997.0 for s in samples]


score_reward.batched = True


def write_prompts(path: str, *, rows: int, prompt_len: int) -> None:
    """JSONL of ``{"prompt": "3907..."}``: ``prompt_len`` random digits each (one token a digit)."""
    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(rows):
            f.write(json.dumps({"prompt": "".join(str(rng.randrange(10)) for _ in range(prompt_len))}) + "\n")


class PhasePeaks(PhaseObserver):
    """The allocated peak of every trainer phase, as an observer of the trainer's PhaseTimer that
    reads each ended phase's peak from the run's peak owner (``trainer.colocation.peaks``,
    :class:`tidal.logging.memory_peaks.DevicePeaks`: the only resetter of the allocator's counter)."""

    def __init__(self, peaks):
        self.peaks, self.points = peaks, []

    def phase_end(self, name, seconds):
        p = self.peaks.last.get(name) if self.peaks.cuda else None
        self.points.append({"label": f"{name}:end", "peak": p.allocated if p else None})

    def pop(self) -> list[dict]:
        points, self.points = self.points, []
        return points


def phase_peaks(points: list[dict]) -> dict[str, float]:
    """Largest allocated peak (GiB) of each trainer phase in a MemoryRecorder timeline."""
    out: dict[str, float] = {}
    for p in points:
        if p["label"].endswith(":end") and p.get("peak") is not None:
            name = p["label"][: -len(":end")]
            out[name] = max(out.get(name, 0.0), p["peak"] / GIB)
    return out


def compare(plan, measured_phases: dict[str, float]) -> dict[str, dict]:
    """Per plan phase: predicted allocated GiB and the measured peak of the trainer phases it stands for."""
    out = {}
    for ph in plan.phases:
        seen = [measured_phases[n] for n in PHASE_MAP.get(ph.name, ()) if n in measured_phases]
        out[ph.name] = {"predicted_gib": round(ph.allocated / GIB, 3), "measured_gib": round(max(seen), 3) if seen else None}
    return out


def config_dict(args, work: str) -> dict:
    return {
        "run": {"output_dir": os.path.join(work, "run"), "steps": args.steps, "seed": 1, "device": "cpu" if args.tiny else "cuda"},
        "model": {"path": os.path.join(work, f"model_{args.size}"),
                  "lora": {"rank": args.lora, "alpha": 2.0 * args.lora} if args.lora else {}},
        "data": {"train": [{"path": os.path.join(work, f"prompts_{args.prompt_len}.jsonl")}], "apply_chat_template": False,
                 "max_prompt_len": args.prompt_len},
        "rollout": {"prompts_per_step": args.sequences // args.samples, "n_samples": args.samples, "max_new_tokens": args.new_tokens,
                    "ignore_eos": True},
        "optim": {"lr": 1e-6},
        "reward": {"components": {"score": {"type": "function", "path": f"{MODULE}:score_reward"}},
                   "recipes": {"default": [["score", 1.0]]}, "default_recipe": "default"},
        "eval": {"at_start": False, "at_end": False, "every": 0},
        "checkpoint": {"every": 0, "at_end": False, "resume": "never"},
        "logging": {"backends": []},
    }


def prepare(args, work: str) -> None:
    shape = SHAPES[args.size]
    os.makedirs(work, exist_ok=True)
    build_model_dir(os.path.join(work, f"model_{args.size}"), shape, "cpu" if args.tiny else "cuda")
    data = os.path.join(work, f"prompts_{args.prompt_len}.jsonl")
    if not os.path.exists(data):
        write_prompts(data, rows=max(4096, args.sequences), prompt_len=args.prompt_len)


def run(args) -> dict:
    import torch
    from transformers import AutoConfig

    from tidal.algorithms import Algorithm
    from tidal.build import build_trainer
    from tidal.config import TidalConfig
    from tidal.config_base import apply_overrides, build
    from tidal.memory.probe import make_plan

    work = os.path.abspath(args.workdir)
    prepare(args, work)
    overrides = list(args.set) + ([f"memory.device_memory_gib={args.device_gib}"] if args.tiny else [])
    cfg = build(TidalConfig, apply_overrides(config_dict(args, work), overrides))
    cuda = not args.tiny
    device = torch.device("cuda" if cuda else "cpu")
    # the run's plan, made as build_trainer makes it, before anything is on the device
    algorithm = Algorithm(cfg.algorithm)
    teacher = AutoConfig.from_pretrained(cfg.model.teacher.path) if cfg.model.teacher.path else None
    plan = make_plan(cfg, AutoConfig.from_pretrained(cfg.model.path), device=device, world_size=1,
                     needs_reference=algorithm.needs_reference, needs_critic=algorithm.needs_critic, teacher_hf_config=teacher)
    if args.snapshot and cuda:
        torch.cuda.memory._record_memory_history(max_entries=200000)
    t0 = time.perf_counter()
    trainer = build_trainer(cfg)
    init_s = time.perf_counter() - t0
    used = trainer.cfg  # the run's config with its `auto` settings resolved
    same_choice = (used.train.micro_batch_tokens, used.train.forward_micro_batch_tokens, used.model.gradient_checkpointing,
                   trainer.colocation.strategy.cfg.offload_optimizer, trainer.colocation.sleep_level) == (
                       plan.choice.micro_batch_tokens, plan.choice.forward_micro_batch_tokens, plan.choice.gradient_checkpointing,
                       plan.choice.offload_optimizer, plan.choice.sleep_level)
    rec = PhasePeaks(trainer.colocation.peaks)
    trainer.timer.add_observer(rec)
    base = {"figure": "memory_plan", "size": args.size, "lora": args.lora, "sequences": args.sequences, "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens, "set": list(args.set), "chosen": plan.chosen(), "fits": plan.fits, "same_choice": same_choice,
            "settings": {"train.micro_batch_tokens": used.train.micro_batch_tokens,
                         "train.forward_micro_batch_tokens": used.train.forward_micro_batch_tokens,
                         "model.gradient_checkpointing": used.model.gradient_checkpointing,
                         "strategy.offload_optimizer": used.strategy.offload_optimizer, "engine.sleep_level": used.engine.sleep_level,
                         "predicted_kv_cache_tokens": plan.kv_cache_tokens},
            "predicted_peak_gib": round(plan.predicted_peak_allocated_gib, 3), "init_s": round(init_s, 1),
            "device": torch.cuda.get_device_name() if cuda else "cpu", "commit": git_commit()}
    steps = []
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        try:
            trainer.train_step(step)
        except torch.OutOfMemoryError as e:  # what the plan missed: the phases' peaks so far and the largest live blocks
            emit(args, {**base, "kind": "oom", "step": step, "error": str(e)[:1500], "phases": compare(plan, phase_peaks(rec.pop())),
                        "largest_blocks": largest_blocks() if args.snapshot else None,
                        "host_peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB, 2),
                        "host_planned_gib": round(plan.host_bytes / GIB, 2), "plan": plan.table()})
            raise
        wall = time.perf_counter() - t0
        points = rec.pop()
        # each phase's own peak (the owner folds and resets at every boundary): the iteration's peak is their largest
        measured = max(phase_peaks(points).values(), default=None) if cuda else None
        record = {**base, "kind": "step", "step": step, "wall_s": round(wall, 2),
                  "measured_peak_gib": round(measured, 3) if measured is not None else None,
                  "ratio": round(measured / plan.predicted_peak_allocated_gib, 3) if measured is not None else None,
                  "phases": compare(plan, phase_peaks(points))}
        steps.append(record)
        emit(args, record)
    steady = steps[1:] or steps  # the first iteration compiles
    peaks = [s["measured_peak_gib"] for s in steady if s["measured_peak_gib"] is not None]
    summary = {**base, "kind": "summary", "measured_peak_gib": max(peaks) if peaks else None,
               "ratio": round(max(peaks) / plan.predicted_peak_allocated_gib, 3) if peaks else None,
               "host_peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB, 2),
               "host_planned_gib": round(plan.host_bytes / GIB, 2), "first_iteration_s": steps[0]["wall_s"],
               "steady_iteration_s": steady[-1]["wall_s"], "plan": plan.table()}
    emit(args, summary)
    return summary


def largest_blocks(n: int = 25) -> list[dict]:
    """The ``n`` largest live allocations (GiB) with the innermost Python frames that made them,
    from the allocator's snapshot (``--snapshot`` records the history that names the frames)."""
    import torch

    blocks = []
    for seg in torch.cuda.memory._snapshot()["segments"]:
        for b in seg["blocks"]:
            if b["state"] == "active_allocated":
                frames = [f"{f['filename'].rsplit('/', 2)[-1]}:{f['line']}:{f['name']}" for f in b.get("frames", [])
                          if f["filename"].endswith(".py")][:6]
                blocks.append({"gib": round(b["size"] / GIB, 3), "frames": frames})
    return sorted(blocks, key=lambda b: -b["gib"])[:n]


def emit(args, record: dict) -> None:
    line = json.dumps(record)
    print(line, flush=True)
    if args.record:
        with open(args.record, "a") as f:
            f.write(line + "\n")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", choices=sorted(SHAPES), default="0.5b")
    p.add_argument("--lora", type=int, default=0, help="LoRA rank (0: full fine-tune)")
    p.add_argument("--sequences", type=int, default=256)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=1024)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--set", action="append", default=[], help="a config override key=value (repeatable)")
    p.add_argument("--workdir", default="/tmp/tidal_memory_check")
    p.add_argument("--record", default=os.path.join(HERE, "results", "memory_check.jsonl"))
    p.add_argument("--snapshot", action="store_true", help="record the allocator's history; an out-of-memory error then "
                   "lists the largest live blocks and where they were allocated")
    p.add_argument("--tiny", action="store_true", help="tiny model on CPU (checks the script; nothing is measured)")
    p.add_argument("--device-gib", type=float, default=80.0, help="with --tiny: the device the plan is made for")
    args = p.parse_args(argv)
    if args.tiny:
        args.size = "tiny"
    if args.sequences % args.samples:
        p.error("--sequences must be a multiple of --samples")
    return args


if __name__ == "__main__":
    run(parse_args())
