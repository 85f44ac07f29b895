"""The TRL runner: TRL 1.16 ``GRPOTrainer`` with Hugging Face ``generate`` (no vLLM), and the
summary of its records.

TRL is observed and steered through public mechanisms only:

- a ``transformers.TrainerCallback`` (:func:`step_timer`) times each optimizer step (one rollout
  and its update: ``gradient_accumulation_steps = steps_per_generation = seqs / micro-batch``) and
  keeps TRL's own logged metrics (``completions/*``, ``kl``);
- ``GRPOTrainer(rollout_func=...)`` (a documented argument, marked experimental by TRL):
  :class:`HFGeneration` makes the rollout exactly as TRL's own non-vLLM path does (the prompts
  tokenized by the processing class and left-padded, ``trl.models.unwrap_model_for_generation`` with
  the trainer's generation kwargs, ``no_grad``, ``generate`` with the trainer's
  ``generation_config``, completions cut after the first EOS), timed around ``generate``, and for
  natural lengths passes a ``transformers.LogitsProcessor`` (:func:`end_at_length`) that ends row j
  with EOS at exactly its drawn length (EOS masked before it, forced at it), the draws Tidal's
  runner uses. Forced lengths use TRL's ``generation_kwargs={"min_new_tokens": max_new_tokens}``.
"""

from __future__ import annotations

import json
import statistics
import time

from bench.grpo.procs import Sink, first_error
from bench.grpo.rewards import trl_reward
from bench.grpo.settings import RunSettings, trl_micro_batch
from bench.grpo.tidal_runner import KL_COEF, split_steps
from bench.grpo.workloads import Workload


def end_at_length(lengths: list[int], eos_ids: list[int], prompt_width: int):
    """A ``transformers.LogitsProcessor`` that ends row j's completion with EOS at exactly
    ``lengths[j]`` tokens: every EOS id is masked before that step and every other token at it.
    ``prompt_width``: the batch's padded prompt length (the completion starts after it)."""
    import torch
    from transformers import LogitsProcessor

    lengths_B = torch.tensor(lengths)
    eos = torch.tensor(sorted(set(eos_ids)))

    class EndAtLength(LogitsProcessor):
        def __call__(self, input_ids, scores_BV):
            t = input_ids.shape[1] - prompt_width + 1  # the 1-based position of the token sampled now
            lens = lengths_B.to(scores_BV.device)
            is_eos_V = torch.zeros(scores_BV.shape[1], dtype=torch.bool, device=scores_BV.device)
            is_eos_V[eos.to(scores_BV.device)] = True
            before_BV = (lens > t)[:, None] & is_eos_V[None, :]
            at_BV = (lens == t)[:, None] & ~is_eos_V[None, :]
            return scores_BV.masked_fill(before_BV | at_BV, -torch.inf)

    return EndAtLength()


class HFGeneration:
    """TRL's ``rollout_func``: one call per rollout (the generation batch of ``seqs`` rows, grouped
    by prompt as TRL's sampler repeats them). ``log`` gets one entry per call: seconds, rows, prompt
    width, completion lengths and whether they are the expected ones."""

    def __init__(self, workload: Workload, seed: int, cuda: bool):
        self.workload, self.seed, self.cuda = workload, seed, cuda
        self.log: list[dict] = []

    def __call__(self, prompts: list[str], trainer) -> dict:
        import torch
        from trl.models import unwrap_model_for_generation

        tok = trainer.processing_class
        ids = tok(text=prompts)["input_ids"]
        width = max(len(i) for i in ids)
        device = trainer.accelerator.device
        input_ids = torch.tensor([[tok.pad_token_id] * (width - len(i)) + list(i) for i in ids], device=device)
        attention_mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids], device=device)
        expected = self.workload.completion_lengths(len(self.log), self.seed)
        processors = None
        if self.workload.lengths == "natural":
            from transformers import LogitsProcessorList

            processors = LogitsProcessorList([end_at_length(expected, list(trainer.eos_token_ids), width)])
        with unwrap_model_for_generation(trainer.model_wrapped, trainer.accelerator,
                                         gather_deepspeed3_params=trainer.args.ds3_gather_for_generation,
                                         generation_kwargs=trainer.generation_kwargs,
                                         gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs) as model, \
                torch.no_grad():
            self._sync()
            t0 = time.perf_counter()
            out = model.generate(input_ids=input_ids, attention_mask=attention_mask,
                                 generation_config=trainer.generation_config, logits_processor=processors)
            self._sync()
            seconds = time.perf_counter() - t0
        completion_ids = cut_after_eos(out[:, width:].tolist(), set(trainer.eos_token_ids))
        lengths = [len(c) for c in completion_ids]
        self.log.append({"seconds": seconds, "batch": len(ids), "prompt_len": width, "lengths": lengths,
                         "lengths_as_expected": lengths == expected})
        return {"prompt_ids": [list(i) for i in ids], "completion_ids": completion_ids, "logprobs": None}

    def _sync(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize()


def cut_after_eos(rows: list[list[int]], eos_ids: set[int]) -> list[list[int]]:
    """Each row up to and including its first EOS (the whole row when it has none), as TRL does."""
    out = []
    for row in rows:
        end = next((i + 1 for i, t in enumerate(row) if t in eos_ids), len(row))
        out.append(row[:end])
    return out


def worker_trl(spec: dict, sink: Sink) -> None:
    """Run TRL's GRPOTrainer for the warm-up + timed steps of one case."""
    try:
        import datasets  # noqa: F401
        import trl  # noqa: F401
    except ImportError as e:
        sink.write({"kind": "error", "message": f"TRL not importable ({e}); bring it with bench/prepare_wheels.sh (carry .whl)"})
        return
    import torch
    from transformers import AutoTokenizer

    cuda = spec["device"] == "cuda"
    if not cuda:
        torch.set_num_threads(1)
    t0 = time.perf_counter()
    trainer, generation = build_trl(spec, AutoTokenizer.from_pretrained(spec["tokenizer_dir"]), cuda, sink)
    sink.write({"kind": "init", "init_s": time.perf_counter() - t0,
                "config": {k: v for k, v in trainer.args.to_dict().items() if isinstance(v, (int, float, str, bool, type(None)))}})
    trainer.train()
    sink.write({"kind": "done", "peak_allocated": torch.cuda.max_memory_allocated() if cuda else None,
                "peak_reserved": torch.cuda.max_memory_reserved() if cuda else None, "generate_calls": len(generation.log)})


def build_trl(spec: dict, tokenizer, cuda: bool, sink: Sink):
    import datasets
    from trl import GRPOConfig, GRPOTrainer

    w, s = Workload(**spec["workload"]), RunSettings(**spec["settings"])
    rows = [json.loads(line) for line in open(spec["data"])]
    micro = trl_micro_batch(s, w.seqs, w.prompt_len + w.max_new_tokens)
    ga = w.seqs // micro
    args = GRPOConfig(
        output_dir=spec["run_dir"], report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True,
        max_steps=s.trl_warmup + s.trl_steps, seed=s.seed, learning_rate=s.lr, max_grad_norm=1.0,
        per_device_train_batch_size=micro, gradient_accumulation_steps=ga, steps_per_generation=ga,
        num_generations=w.samples, num_iterations=1, max_completion_length=w.max_new_tokens, temperature=1.0,
        generation_kwargs={"min_new_tokens": w.max_new_tokens} if w.lengths == "forced" else {},
        beta=KL_COEF if w.kl else 0.0, gradient_checkpointing=s.trl_gradient_checkpointing, bf16=cuda, use_cpu=not cuda,
        dataloader_num_workers=0, model_init_kwargs={"dtype": s.trl_dtype},
    )
    generation = HFGeneration(w, s.seed, cuda)
    trainer = GRPOTrainer(model=spec["model_dir"], reward_funcs=trl_reward, args=args, rollout_func=generation,
                          train_dataset=datasets.Dataset.from_list(rows), processing_class=tokenizer)
    trainer.add_callback(step_timer(sink, generation.log, spec["deadline"], cuda))
    return trainer, generation


def step_timer(sink: Sink, gen_log: list[dict], deadline: float, cuda: bool):
    """A ``TrainerCallback``: wall time between consecutive optimizer-step ends (everything the loop
    does per iteration), the generations in it, TRL's logs; stops training before the deadline."""
    import torch
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            self.t_last, self.n_gen = time.perf_counter(), 0

        def on_step_end(self, args, state, control, **kw):
            if cuda:
                torch.cuda.synchronize()
            now = time.perf_counter()
            wall, self.t_last = now - self.t_last, now
            gens = gen_log[self.n_gen:]
            self.n_gen = len(gen_log)
            sink.write({"kind": "step", "step": state.global_step, "wall_s": wall,
                        "generate_s": sum(g["seconds"] for g in gens), "generate": gens,
                        "peak_allocated": torch.cuda.max_memory_allocated() if cuda else None})
            if time.time() + 1.3 * wall > deadline and state.global_step < state.max_steps:
                sink.write({"kind": "stopped", "reason": "deadline", "after_step": state.global_step})
                control.should_training_stop = True

        def on_log(self, args, state, control, logs=None, **kw):
            keep = {k: v for k, v in (logs or {}).items() if isinstance(v, (int, float))}
            sink.write({"kind": "log", "step": state.global_step, "logs": keep})

    return StepTimer()


# ---- summary (parent side) ---------------------------------------------------------------------------
def trl_checks(steps: list[dict], logs: list[dict], w: Workload) -> dict[str, bool]:
    """One generation per optimizer step over ``seqs`` rows of ``prompt_len`` tokens with the
    expected completion lengths, and TRL's own metrics agree: min/max length, the clipped ratio
    (forced: all clipped, no EOS; natural: none, every row ends with EOS), a ``kl`` metric iff KL."""
    gens = [g for r in steps for g in r["generate"]]
    clipped = 1.0 if w.lengths == "forced" else 0.0
    return {
        "one_generation_per_step": bool(steps) and all(len(r["generate"]) == 1 for r in steps),
        "completions_per_generation": bool(gens) and all(g["batch"] == w.seqs for g in gens),
        "prompt_len": bool(gens) and all(g["prompt_len"] == w.prompt_len for g in gens),
        "completion_lengths": bool(gens) and all(g["lengths_as_expected"] for g in gens),
        "completion_length_metrics": bool(logs) and all(
            lg.get("completions/min_length") == min(g) and lg.get("completions/max_length") == max(g)
            for lg, g in zip(logs, (x["lengths"] for x in gens))),
        "clipped_ratio": bool(logs) and all(lg.get("completions/clipped_ratio") == clipped for lg in logs),
        "reference_model_iff_kl": bool(logs) and all(("kl" in lg) == w.kl for lg in logs),
    }


def summarize_trl(records: list[dict], w: Workload, s: RunSettings) -> dict:
    """Aggregate a TRL worker's records: steady optimizer steps, generate time, peaks, checks."""
    init = next((r for r in records if r["kind"] == "init"), {})
    done = next((r for r in records if r["kind"] == "done"), {})
    warm, steady = split_steps([r for r in records if r["kind"] == "step"], s.trl_warmup)
    all_steps = warm + steady
    logs = [r["logs"] for r in records if r["kind"] == "log" and "completions/mean_length" in r["logs"]]
    peak = done.get("peak_allocated") or max((r["peak_allocated"] for r in all_steps if r["peak_allocated"]), default=None)
    return {
        "error": first_error(records), "init_s": init.get("init_s"),
        "warmup_s": [r["wall_s"] for r in warm], "steady_s": [r["wall_s"] for r in steady],
        "steps_s": [r["wall_s"] for r in all_steps],
        "first_iteration_s": all_steps[0]["wall_s"] if all_steps else None,
        "checks": trl_checks(all_steps, logs, w),
        "phases": {"generate": statistics.median([r["generate_s"] for r in steady])} if steady else {},
        "lengths_per_step": [g["lengths"] for r in steady for g in r["generate"][:1]],
        "stopped_early": any(r["kind"] == "stopped" for r in records),
        "peak_allocated": peak, "peak_reserved": done.get("peak_reserved"),
    }
