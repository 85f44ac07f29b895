"""End-to-end GRPO iteration benchmark on one GPU: Tidal against TRL's ``GRPOTrainer`` (issue 8).

Both frameworks train the same random-initialised model folder (saved once, bf16 on disk, loaded as
fp32 master weights with bf16 compute by both) on the same batch: 16 prompts x 8 samples, prompt 128
tokens, 256 completion tokens forced (Tidal ``rollout.ignore_eos``; TRL ``min_new_tokens``), KL off,
one optimizer step per rollout, the same deterministic reward (:func:`bench_score` of the completion
token ids, so reward time is not the figure). Each (framework, size, KL) case runs in its own
subprocess so its peak-memory figures are its own. Cases:

- sizes ``0.5b`` (Qwen2-0.5B shape: hidden 896, 24 layers, 14/2 heads, intermediate 4864, vocab
  151936) and ``1.5b`` (hidden 1536, 28 layers, 12/2 heads, intermediate 8960); tied embeddings.
- KL ``off`` (no reference model) and ``on`` (Tidal ``algorithm.kl_coef`` = TRL ``beta`` = 0.04,
  k3 estimator, a reference model).
- TRL 1.16 without vLLM (HF ``generate``), ``gradient_checkpointing=False`` (TRL defaults to True;
  off is its faster setting, and Tidal's default), micro-batches of ``--trl-micro-batch``
  completions with ``gradient_accumulation_steps = 128 / micro-batch``, so one generation of 128
  completions feeds exactly one optimizer step (``steps_per_generation`` = accumulation steps).

Figures (one JSON line each on stdout): the ceilings (device copy bandwidth, counting bytes read plus
written, and the bf16 matmul rate, both measured here); per case the steady-state seconds per
iteration (median after warm-up) and the whole-process peak GPU memory; for Tidal each phase
(``time/<phase>`` of ``PPOTrainer.train_step``) against its own lower bound, the iteration's bound,
the weight-sync bandwidth, and the memory timeline of the last iteration (allocated/reserved bytes of
the torch allocator and bytes in use on the device, which include the engine's KV cache when it lives
outside the allocator at a fixed address, at every phase boundary and around every
sleep/wake/offload/reload/weight-sync call, recorded by wrapping those methods from outside Tidal); TRL's ``generate`` time (wrapped likewise); TRL/Tidal ratios.

Bounds (all lower bounds, from the measured ceilings; N = parameters with tied embeddings counted once,
which is also the number of weights in matmuls since the LM head is the embedding):
- generate: prefill ``2 N x unique prompt tokens / matmul`` plus, per decode step k = 1..R-1,
  ``max((2 N + seqs x (P + k) x kv_bytes) / copy_bw, 2 N seqs / matmul)`` (bf16 weights and KV read
  once per step).
- actor/reference logprobs: ``2 N x tokens / matmul`` (the actor's only when the run has that pass:
  with one optimizer step per rollout Tidal takes the old logprobs from the update's forward);
  train: ``6 N x tokens / matmul`` plus the AdamW update (28 bytes per parameter read+written in
  fp32) over copy_bw; tokens = seqs x (P + R).
- weight sync: ``6 N / copy_bw`` (read fp32 master, write bf16 engine copy).

Profile (``--profile DIR``): after the timed iterations of the main Tidal case (the first one planned:
first size, first KL setting), ONE more iteration runs under ``torch.profiler.profile`` (CPU + CUDA
activities on CUDA, CPU only otherwise); it is in neither the medians nor the memory timeline, and
the timed iterations run exactly as without the option (the profiler hook is installed for that
iteration only; the case's run.steps grows by one and its time cap by ``PROFILE_EXTRA_S``). Each
phase ``time/<phase>`` times becomes a ``record_function("phase/<name>")`` range, put around the
PhaseTimer hook the bench already wraps (outside its CUDA syncs); ``iteration`` is the whole
``train_step``. Events are restricted per range by time interval, not by the profiler's schedule:
a host event belongs to a range if it starts inside it (any thread: autograd runs the backward on
its own), a kernel/memcpy/memset if the runtime call that launched it does (matched by CUPTI
correlation id; by its own start only when no call matches, counted in ``kernels_matched_by``).
This is reliable because the PhaseTimer synchronizes at both ends of a phase, so a phase's device
work also runs inside its range. DIR receives:
- ``phases.txt``: per range, ``key_averages()`` of exactly its events, top 25 by self device time
  and top 25 by self CPU time (self CPU time only, on CPU); a ``phase/<name>`` row's self CPU time is
  host time outside any recorded op (Python, or waiting on the autograd thread).
- ``summary.json``: per range its wall seconds (and the timer's), device-kernel seconds, device busy
  seconds (union of kernels and copies), idle fraction ``1 - busy / wall``, kernels executed, launch
  calls (``*Launch*`` runtime/driver calls) and CUDA-graph launches, host syncs by API name
  (``*Synchronize*``, blocking ``cudaMemcpy``; these include the bench's own: 2
  ``cudaDeviceSynchronize`` per phase entry from the PhaseTimer and 2 per Strategy call the
  MemoryRecorder wraps), DtoH copies, the top 5 kernels and the top 5 host ops.
- ``trace.json.gz``: the Chrome trace, kept only up to ``--profile-trace-mb`` (default 15, since the
  device machine returns files of at most 16 MiB; ``0``: none); else deleted, and the figure says so.
The ``profile`` figure summarises it per range next to the unprofiled medians; like every figure it
is appended to a record file only with ``--record``. A failed or skipped profile is a ``profile``
figure with ``error``; the case's timings stand.

Usage (GPU; TRL comes from wheels, see bench/prepare_wheels.sh):
    python bench/e2e_grpo.py [--only tidal|trl] [--sizes 0.5b,1.5b] [--kl off|on|both]
        [--time-budget-s 480] [--record [PATH]] [--out-dir DIR] [--tidal-set key=value ...]
        [--profile DIR [--profile-trace-mb 15]]
    python bench/e2e_grpo.py --tiny          # CPU smoke run: tiny model, 2 prompts x 2, 8 tokens
    python bench/e2e_grpo.py --tiny --only tidal --kl off --profile /tmp/prof   # profile path, on CPU
Cases run in priority order (cheapest first: 0.5b off, then KL on / 1.5b, TRL after Tidal at each
level); a case that cannot start inside the budget is reported as skipped, one that runs out of time
stops after its current step and reports the steps it has.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
DEFAULT_RECORD = os.path.join(HERE, "results", "e2e_grpo.jsonl")
GIB = 2**30

SHAPES = {
    "0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, vocab_size=151936),
    "1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                 intermediate_size=8960, vocab_size=151936),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=1024),
}
SIZE_ORDER = ["0.5b", "1.5b"]
KL_COEF = 0.04
# Seconds a case is allowed at most (it stops after the step that would overrun) and needs at least to start.
CASE_CAP_S = {("tidal", "0.5b"): 180, ("tidal", "1.5b"): 220, ("trl", "0.5b"): 150, ("trl", "1.5b"): 220}
CASE_MIN_S = 45
TIDAL_MICRO_BATCH_TOKENS = 49152  # train.micro_batch_tokens of the Tidal cases: with 64 rows at most, 2 x 64 x 384


@dataclasses.dataclass(kw_only=True)
class BenchSettings:
    """What every case of one run shares.

    prompts x samples sequences per iteration, prompt_len tokens each (exactly), new_tokens completion
    tokens forced. warmup iterations are run and not counted; steps are timed (per framework, since a
    TRL iteration takes ~10x longer). trl_micro_batch: completions per TRL forward/backward;
    trl_dtype: TRL's model_init dtype; trl_gradient_checkpointing: TRL's own default is True, the
    benchmark's False (faster, and Tidal's default).
    """

    prompts: int = 16
    samples: int = 8
    prompt_len: int = 128
    new_tokens: int = 256
    tidal_warmup: int = 2
    tidal_steps: int = 5
    trl_warmup: int = 1
    trl_steps: int = 3
    trl_micro_batch: int = 32
    trl_dtype: str = "float32"
    trl_gradient_checkpointing: bool = False
    lr: float = 1e-6
    seed: int = 1

    def __post_init__(self):
        for name in ("prompts", "prompt_len", "new_tokens", "tidal_steps", "trl_steps", "trl_micro_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.samples < 2:
            raise ValueError(f"samples must be >= 2 (GRPO groups), got {self.samples}")
        if (self.prompts * self.samples) % self.trl_micro_batch:
            raise ValueError(f"trl_micro_batch ({self.trl_micro_batch}) must divide prompts x samples ({self.prompts * self.samples})")
        if self.trl_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"trl_dtype must be float32 or bfloat16, got {self.trl_dtype!r}")

    @property
    def seqs(self) -> int:
        return self.prompts * self.samples


TINY = dict(prompts=2, samples=2, prompt_len=8, new_tokens=8, tidal_warmup=1, tidal_steps=2, trl_warmup=1,
            trl_steps=2, trl_micro_batch=2)


# ---- the reward (both frameworks) ------------------------------------------------------------------
def bench_score(completion_ids) -> float:
    """A deterministic score in [0, 1) of a completion's token ids (varies within a group, costs ~nothing)."""
    return (sum(int(t) for t in completion_ids) % 997) / 997.0


def tidal_reward(samples) -> list[float]:
    """Tidal batched reward function (``e2e_grpo:tidal_reward``): one RewardSample list in, scores out."""
    return [bench_score(s.response_ids) for s in samples]


tidal_reward.batched = True


def trl_reward(prompts, completions, completion_ids, **kwargs) -> list[float]:
    """TRL reward function: same score from the completion token ids."""
    return [bench_score(ids) for ids in completion_ids]


# ---- model shape and bounds (pure) -----------------------------------------------------------------
def param_count(shape: dict) -> int:
    """Parameters of a Qwen2 model with tied embeddings (q/k/v biases, no o bias, 2 norms per layer)."""
    h, layers, inter, vocab = shape["hidden_size"], shape["num_hidden_layers"], shape["intermediate_size"], shape["vocab_size"]
    kv = shape["num_key_value_heads"] * (h // shape["num_attention_heads"])
    attn = (h * h + h) + 2 * (h * kv + kv) + h * h
    per_layer = attn + 3 * h * inter + 2 * h
    return layers * per_layer + vocab * h + h


def kv_bytes_per_token(shape: dict, dtype_bytes: int = 2) -> int:
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    return 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * head_dim * dtype_bytes


def generation_bound_s(*, n_params: int, kv_bytes: int, seqs: int, unique_prompts: int, prompt_len: int,
                       new_tokens: int, copy_bw: float, matmul_flops: float) -> float:
    """Prefill of the unique prompts at the matmul rate, then R-1 decode steps, each bounded by reading
    the bf16 weights and every sequence's KV once (copy_bw) or by its matmul flops, whichever is larger."""
    total = 2.0 * n_params * unique_prompts * prompt_len / matmul_flops
    for k in range(1, new_tokens):
        read = 2.0 * n_params + seqs * (prompt_len + k) * kv_bytes
        total += max(read / copy_bw, 2.0 * n_params * seqs / matmul_flops)
    return total


def forward_bound_s(*, n_params: int, tokens: int, matmul_flops: float) -> float:
    return 2.0 * n_params * tokens / matmul_flops


def train_bound_s(*, n_params: int, tokens: int, matmul_flops: float, copy_bw: float) -> float:
    """Forward + backward (6 N flops per token) plus one fp32 AdamW update (28 bytes/param moved)."""
    return 6.0 * n_params * tokens / matmul_flops + 28.0 * n_params / copy_bw


def weight_sync_bound_s(*, n_params: int, copy_bw: float) -> float:
    return 6.0 * n_params / copy_bw


def phase_bounds(*, n_params: int, shape: dict, s: BenchSettings, kl: bool, copy_bw: float, matmul_flops: float,
                 old_logprobs: bool = True) -> dict[str, float]:
    """Lower bound in seconds of each Tidal phase that has one (see the module docstring);
    ``old_logprobs``: the run had a separate old-logprob pass (else the update's forward gave them)."""
    tokens = s.seqs * (s.prompt_len + s.new_tokens)
    fwd = forward_bound_s(n_params=n_params, tokens=tokens, matmul_flops=matmul_flops)
    out = {
        "generate": generation_bound_s(n_params=n_params, kv_bytes=kv_bytes_per_token(shape), seqs=s.seqs,
                                       unique_prompts=s.prompts, prompt_len=s.prompt_len, new_tokens=s.new_tokens,
                                       copy_bw=copy_bw, matmul_flops=matmul_flops),
        "train": train_bound_s(n_params=n_params, tokens=tokens, matmul_flops=matmul_flops, copy_bw=copy_bw),
        "weight_sync": weight_sync_bound_s(n_params=n_params, copy_bw=copy_bw),
    }
    if old_logprobs:
        out["actor_logprobs"] = fwd
    if kl:
        out["reference_logprobs"] = fwd
    return out


def median_or_none(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


# ---- assets ----------------------------------------------------------------------------------------
def build_tokenizer(vocab_size: int):
    """A WordLevel tokenizer covering the whole vocabulary: ids 0..V-3 are "t0".."t{V-3}", V-2 is
    ``<eos>``, V-1 is ``<pad>``; whitespace split, no special tokens added, no chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size - 2)}
    vocab["<eos>"], vocab["<pad>"] = vocab_size - 2, vocab_size - 1
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", unk_token="<eos>")


def build_model_dir(path: str, shape: dict, device: str) -> int:
    """Save a random-initialised Qwen2 model (bf16 weights) into ``path``; returns N. (The tokenizer
    lives in its own folder: next to a qwen2 config.json, transformers 5 would load the WordLevel files
    as a Qwen2Tokenizer, which encodes these prompts to nothing.)"""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    v = shape["vocab_size"]
    cfg = Qwen2Config(**shape, tie_word_embeddings=True, max_position_embeddings=4096, rope_theta=1000000.0,
                      rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=v - 2, pad_token_id=v - 1)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(cfg)
    model = model.to(torch.bfloat16)
    n = sum(p.numel() for p in model.parameters())
    model.save_pretrained(path)
    del model
    return n


def write_prompts(path: str, *, rows: int, prompt_len: int, vocab_size: int, seed: int = 0) -> None:
    """JSONL of ``{"prompt": "t.. t.. ..."}``: each prompt is ``prompt_len`` random vocabulary words."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(rows):
            f.write(json.dumps({"prompt": " ".join(f"t{rng.randrange(vocab_size - 2)}" for _ in range(prompt_len))}) + "\n")


# ---- ceilings --------------------------------------------------------------------------------------
def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Device copy bandwidth in bytes/s counting bytes read plus written (median of 20 after 5 warm-ups)."""
    import torch

    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    times = _event_times(lambda: dst.copy_(src), 25, 5)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / statistics.median(times)


def matmul_rate(n: int = 8192) -> float:
    """bf16 n x n x n matmul flop/s on random data (median of 10 after 3 warm-ups)."""
    import torch

    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    times = _event_times(lambda: a @ b, 13, 3)
    del a, b
    torch.cuda.empty_cache()
    return 2.0 * n**3 / statistics.median(times)


def _event_times(fn, total: int, skip: int) -> list[float]:
    import torch

    out = []
    for i in range(total):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        if i >= skip:
            out.append(start.elapsed_time(end) / 1e3)
    return out


# ---- worker plumbing ---------------------------------------------------------------------------------
class Sink:
    """Append-only JSON-lines file, flushed per record (a killed worker leaves every finished record)."""

    def __init__(self, path: str):
        self.f = open(path, "a")

    def write(self, record: dict) -> None:
        self.f.write(json.dumps(record) + "\n")
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


def worker_setup(spec: dict, sink: Sink) -> None:
    """Build (or reuse) the model folders and prompts; on CUDA measure the ceilings."""
    import torch
    import transformers

    device = "cuda" if spec["device"] == "cuda" else "cpu"
    env = {"kind": "env", "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
           "torch": torch.__version__, "transformers": transformers.__version__, "python": sys.version.split()[0]}
    for name in ("trl", "datasets", "pyarrow", "accelerate"):
        env[name] = _version_of(name)
    sink.write(env)
    s = BenchSettings(**spec["settings"])
    for size in spec["sizes"]:
        shape = SHAPES[size]
        model_dir = os.path.join(spec["work_dir"], f"model-{size}")
        marker = os.path.join(model_dir, "bench_shape.json")
        if os.path.exists(marker) and json.load(open(marker)) == shape:
            n = param_count(shape)
        else:
            n = build_model_dir(model_dir, shape, device)
            json.dump(shape, open(marker, "w"))
        tok_dir = os.path.join(spec["work_dir"], f"tokenizer-{shape['vocab_size']}")
        if not os.path.exists(os.path.join(tok_dir, "config.json")):
            build_tokenizer(shape["vocab_size"]).save_pretrained(tok_dir)
            # Tidal's load_tokenizer wants a config.json; one without a model_type keeps the class as saved.
            json.dump({"tokenizer_class": "PreTrainedTokenizerFast"}, open(os.path.join(tok_dir, "config.json"), "w"))
        data = os.path.join(spec["work_dir"], f"prompts-{size}.jsonl")
        write_prompts(data, rows=max(64, s.prompts * 16), prompt_len=s.prompt_len, vocab_size=shape["vocab_size"])
        sink.write({"kind": "model", "size": size, "model_dir": model_dir, "tokenizer_dir": tok_dir, "data": data, "params": n,
                    "params_formula": param_count(shape), "shape": shape})
    if device == "cuda":
        sink.write({"kind": "ceilings", "copy_bw": copy_bandwidth(), "matmul_flops": matmul_rate()})


def _version_of(name: str) -> str | None:
    try:
        import importlib.metadata as md

        return md.version(name)
    except Exception:
        return None


# ---- Tidal worker ----------------------------------------------------------------------------------
def memory_recorder(cuda: bool):
    """A :class:`tidal.logging.PhaseObserver` that records (label, allocated, reserved, device used)
    at every phase boundary of Tidal's PhaseTimer (with the phase's own peak: peak stats are reset at
    its start) and around every placement move of the phase owner (``<action>/<role>:before`` /
    ``:after`` events, with the bytes the move returned), plus each rollout's sizes (the
    ``generate:done`` event). Without CUDA the labels are recorded with None bytes."""
    from tidal.logging import PhaseObserver

    class MemoryRecorder(PhaseObserver):
        def __init__(self):
            self.points: list[dict] = []
            self.calls: list[dict] = []
            self.gen_log: list[dict] = []
            self._started: dict[str, float] = {}

        def _mem(self):
            import torch

            if not cuda:
                return None, None, None
            free, total = torch.cuda.mem_get_info()
            return torch.cuda.memory_allocated(), torch.cuda.memory_reserved(), total - free

        def mark(self, label: str, **extra) -> None:
            a, r, used = self._mem()
            self.points.append({"label": label, "allocated": a, "reserved": r, "device_used": used, **extra})

        def peak(self):
            import torch

            return torch.cuda.max_memory_allocated() if cuda else None

        def peak_reserved(self):
            import torch

            return torch.cuda.max_memory_reserved() if cuda else None

        def phase_begin(self, name):
            import torch

            self.mark(f"{name}:start")
            if cuda:
                torch.cuda.reset_peak_memory_stats()

        def phase_end(self, name, seconds):
            self.mark(f"{name}:end", peak=self.peak(), peak_reserved=self.peak_reserved())

        def event(self, name, info=None):
            if name == "generate:done":
                lens = info["completion_lengths"]
                self.gen_log.append({"prompts": info["prompts"], "completions": len(lens), "min_len": min(lens),
                                     "max_len": max(lens)})
                return
            what, _, when = name.rpartition(":")
            returned = (info or {}).get("bytes")
            self.mark(name, **({"returned": returned} if when == "after" else {}))
            if when == "before":
                self._started[what] = time.perf_counter()
            elif when == "after" and what in self._started:
                self.calls.append({"name": what, "seconds": time.perf_counter() - self._started.pop(what), "returned": returned})

        def pop(self):
            points, calls = self.points, self.calls
            self.points, self.calls = [], []
            return points, calls

    return MemoryRecorder()


def tidal_config_dict(spec: dict) -> dict:
    """The Tidal run config of a case (before ``--tidal-set`` overrides)."""
    s = BenchSettings(**spec["settings"])
    cuda = spec["device"] == "cuda"
    kv_tokens = 1 << math.ceil(math.log2(s.seqs * (s.prompt_len + s.new_tokens + 16)))
    return {
        # one more when profiling: the profiled iteration comes after the timed ones (see profile_iteration)
        "run": {"output_dir": spec["run_dir"], "steps": s.tidal_warmup + s.tidal_steps + int(bool(spec.get("profile"))),
                "seed": s.seed,
                "device": "cuda" if cuda else "cpu"},
        "model": {"path": spec["model_dir"], "tokenizer_path": spec["tokenizer_dir"]},
        "data": {"train": [{"path": spec["data"]}], "apply_chat_template": False, "max_prompt_len": s.prompt_len},
        "rollout": {"prompts_per_step": s.prompts, "n_samples": s.samples, "max_new_tokens": s.new_tokens,
                    "ignore_eos": True, "temperature": 1.0},
        "engine": {"kv_cache_max_tokens": kv_tokens},
        "optim": {"lr": s.lr, "max_grad_norm": 1.0},
        # two training micro-batches of 64 sequences (the default 16384-token budget makes four: 42+42+42+2)
        "train": {"micro_batch_tokens": TIDAL_MICRO_BATCH_TOKENS},
        "algorithm": {"advantage": "grpo", "policy_loss": "ppo_clip", "loss_agg": "token_mean",
                      "kl_coef": KL_COEF if spec["kl"] else 0.0, "kl_estimator": "k3"},
        "reward": {"components": {"score": {"type": "function", "path": "e2e_grpo:tidal_reward"}},
                   "recipes": {"default": [["score", 1.0]]}, "default_recipe": "default"},
        "eval": {"at_start": False, "at_end": False, "every": 0},
        "checkpoint": {"every": 0, "at_end": False, "resume": "never"},
        "logging": {"backends": []},
    }


def worker_tidal(spec: dict, sink: Sink) -> None:
    """Build Tidal's trainer from the case config and time ``train_step`` iterations until done or the deadline."""
    import torch
    from tidal.config import TidalConfig
    from tidal.config_base import apply_overrides, build
    from tidal.build import build_trainer

    cuda = spec["device"] == "cuda"
    if not cuda:
        torch.set_num_threads(1)
    s = BenchSettings(**spec["settings"])
    cfg = build(TidalConfig, apply_overrides(tidal_config_dict(spec), spec["tidal_set"]))
    t0 = time.perf_counter()
    trainer = build_trainer(cfg)
    init_s = time.perf_counter() - t0
    rec = memory_recorder(cuda)
    trainer.timer.add_observer(rec)
    prompt_lens = sorted({len(trainer.data.train[i].prompt_ids) for i in range(len(trainer.data.train))})
    sink.write({"kind": "init", "init_s": init_s, "prompt_lens": prompt_lens, "peak_allocated": rec.peak(),
                "peak_reserved": rec.peak_reserved(),
                "config": cfg.to_dict(), "engine_memory": trainer.phases.engine.memory_report()})
    total = s.tidal_warmup + s.tidal_steps
    last = _tidal_loop(trainer, rec, rec.gen_log, total, spec["deadline"], cuda, sink)
    if spec.get("profile"):
        profile_iteration(trainer, rec, total + 1, cuda, spec["profile"], sink, spec["deadline"], last)


def _tidal_loop(trainer, rec, gen_log: list[dict], total: int, deadline: float, cuda: bool, sink: Sink) -> float:
    """Time ``total`` iterations (one "step" record each); returns the last one's seconds."""
    import torch

    last = 0.0
    for step in range(1, total + 1):
        # the first iteration compiles (strategy.compile) and warms up: it predicts nothing about the next
        if step > 2 and time.time() + 1.3 * last > deadline:
            sink.write({"kind": "stopped", "reason": "deadline", "after_step": step - 1})
            return last
        rec.mark("iteration:start")
        engine = trainer.phases.engine
        engine_before = dict(getattr(engine, "stats", {}))
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        metrics = trainer.train_step(step)
        if cuda:
            torch.cuda.synchronize()
        last = time.perf_counter() - t0
        rec.mark("iteration:end")
        points, calls = rec.pop()
        peaks = [p["peak"] for p in points if p.get("peak") is not None]
        peaks_r = [p["peak_reserved"] for p in points if p.get("peak_reserved") is not None]
        sink.write({
            "kind": "step", "step": step, "wall_s": last, "metrics": {k: float(v) for k, v in metrics.items()},
            "peak_allocated": max(peaks) if peaks else None, "peak_reserved": max(peaks_r) if peaks_r else None,
            "timeline": points, "calls": calls, "generate": gen_log[-1] if gen_log else None,
            "engine": {k: v - engine_before.get(k, 0) for k, v in getattr(engine, "stats", {}).items()
                       if isinstance(v, (int, float))},
        })
    return last


# ---- one profiled iteration (--profile) ---------------------------------------------------------------
PHASE_RANGE = "phase/"  # record_function name of a phase's range: "phase/<name>"
ITERATION_RANGE = "iteration"  # the whole profiled train_step (a pseudo-phase in the outputs)
PROFILE_EXTRA_S = 120  # added to the profiled case's cap: one iteration under the profiler plus post-processing
TRACE_MAX_MB = 15.0  # default --profile-trace-mb (the device machine returns files of at most 16 MiB)
SYNC_CALLS = ("cudaMemcpy", "cudaMemcpy2D", "cuMemcpyDtoH", "cuMemcpyDtoH_v2")  # blocking, besides "*Synchronize*"


def profile_iteration(trainer, rec, step: int, cuda: bool, prof_spec: dict, sink: Sink,
                      deadline: float, last_s: float) -> None:
    """Run iteration ``step`` (after every timed one, so it neither changes their timings nor enters the
    medians) under ``torch.profiler.profile`` and write phases.txt, summary.json and trace.json.gz into
    ``prof_spec["dir"]``; one "profile" record (and a "profile_trace" one) goes to the sink.

    Each phase's range comes from the PhaseTimer's observer hook: for this iteration only, an observer
    opens ``record_function("phase/<name>")`` at each phase's begin and closes it at its end, inside the
    PhaseTimer's own CUDA syncs, so every kernel launched in a phase also finishes inside its range. See :func:`analyze_profile` for how events are assigned to ranges. Any failure is reported
    in the record instead of failing the case (its timed iterations are already written).
    """
    import contextlib
    import torch

    need = 3.0 * last_s + 45.0  # the iteration under the profiler, then post-processing
    if time.time() + need > deadline:
        sink.write({"kind": "profile", "error": f"skipped: {deadline - time.time():.0f} s left before the deadline, "
                                                f"needs about {need:.0f} s"})
        return
    try:
        from torch.profiler import ProfilerActivity, profile, record_function

        from tidal.logging import PhaseObserver

        out_dir = prof_spec["dir"]
        os.makedirs(out_dir, exist_ok=True)
        timer = trainer.timer

        class Ranges(PhaseObserver):
            def __init__(self):
                self.open: list[contextlib.AbstractContextManager] = []

            def phase_begin(self, name):
                self.open.append(record_function(PHASE_RANGE + name))
                self.open[-1].__enter__()

            def phase_end(self, name, seconds):
                self.open.pop().__exit__(None, None, None)

        ranges = Ranges()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        timer.add_observer(ranges)
        try:
            with profile(activities=activities, record_shapes=False, with_stack=False, profile_memory=False) as prof:
                if cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                with record_function(ITERATION_RANGE):
                    metrics = trainer.train_step(step)
                    if cuda:
                        torch.cuda.synchronize()
                wall = time.perf_counter() - t0
            t1 = time.perf_counter()
            events = prof.events()
        finally:
            timer.remove_observer(ranges)
            rec.pop()  # this iteration's memory points are not the reported timeline
        summary, text = analyze_profile(events, cuda=cuda)
        summary.update(step=step, device="cuda" if cuda else "cpu", iteration_wall_s=wall, postprocess_s=time.perf_counter() - t1)
        timer_s = {k[5:]: float(v) for k, v in metrics.items() if k.startswith("time/") and k != "time/step"}
        for name, ph in summary["phases"].items():
            ph["timer_s"] = wall if name == ITERATION_RANGE else timer_s.get(name)
        with open(os.path.join(out_dir, "phases.txt"), "w") as f:
            f.write(text)
        _write_json(os.path.join(out_dir, "summary.json"), summary)
        sink.write({"kind": "profile", "dir": out_dir, "files": ["phases.txt", "summary.json"], **summary})
    except Exception as e:
        import traceback

        sink.write({"kind": "profile", "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]})
        return
    trace = _export_trace(prof, out_dir, prof_spec.get("trace_max_mb", TRACE_MAX_MB), len(events), deadline)
    summary["trace"] = trace
    _write_json(os.path.join(out_dir, "summary.json"), summary)
    sink.write({"kind": "profile_trace", **trace})


def _export_trace(prof, out_dir: str, max_mb: float, n_events: int, deadline: float) -> dict:
    """trace.json.gz if it fits in ``max_mb`` (else deleted) and there is time for it; says which."""
    path = os.path.join(out_dir, "trace.json.gz")
    if max_mb <= 0:
        return {"kept": False, "reason": "--profile-trace-mb 0"}
    need = 30.0 + 50e-6 * n_events
    if time.time() + need > deadline:
        return {"kept": False, "reason": f"no time: {deadline - time.time():.0f} s left, about {need:.0f} s needed"}
    try:
        t0 = time.perf_counter()
        prof.export_chrome_trace(path)
        size = os.path.getsize(path)
    except Exception as e:
        return {"kept": False, "reason": f"export failed: {type(e).__name__}: {e}"}
    out = {"bytes": size, "export_s": time.perf_counter() - t0}
    if size > max_mb * 2**20:
        os.remove(path)
        return {**out, "kept": False, "reason": f"{size / 2**20:.1f} MiB > --profile-trace-mb {max_mb:g}: deleted"}
    return {**out, "kept": True, "file": "trace.json.gz"}


def _write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, default=_json_default)


def _interval_union(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by the (start, end) intervals (overlaps counted once)."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return total + (cur_e - cur_s if cur_e is not None else 0.0)


def _is_copy(name: str) -> bool:
    return name.startswith("Memcpy") or name.startswith("Memset")


def analyze_profile(events, *, cuda: bool, top: int = 25) -> tuple[dict, str]:
    """Per-phase figures and tables from one profiled iteration's ``prof.events()``.

    Ranges: the CPU events named ``phase/<name>`` (a phase entered twice has two) and ``iteration``.
    A host event (op, runtime call, range) belongs to a range when it starts inside it, on any thread
    (autograd runs the backward on its own thread). A device event (kernel, memcpy, memset) belongs to
    the range in which it was *launched*: it is matched to its runtime call (``cudaLaunchKernel``,
    ``cuLaunchKernel``, ``cudaGraphLaunch``, ``cudaMemcpyAsync``...) by CUPTI correlation id, and only
    when no runtime call matches is its own start time used (``kernels_matched_by`` counts both).
    Since each range encloses the PhaseTimer's CUDA syncs, a phase's kernels also run inside it, so
    ``device_busy_s`` (union of its device intervals) over ``wall_s`` gives the idle fraction. The
    tables are ``key_averages()`` of an ``EventList`` of exactly those events (a ``phase/<name>``
    row's self CPU time is Python time outside any op).
    """
    import bisect

    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import EventList

    def is_range(e) -> bool:
        return e.name == ITERATION_RANGE or e.name.startswith(PHASE_RANGE)

    cpu = [e for e in events if e.device_type == DeviceType.CPU]
    # device side, without the GPU copies of the record_function annotations
    dev = [e for e in events if e.device_type != DeviceType.CPU and not is_range(e)
           and not getattr(e, "is_user_annotation", False)]
    ranges: dict[str, list[tuple[float, float]]] = {}
    for e in sorted((e for e in cpu if is_range(e)), key=lambda e: e.time_range.start):
        key = ITERATION_RANGE if e.name == ITERATION_RANGE else e.name[len(PHASE_RANGE):]
        ranges.setdefault(key, []).append((e.time_range.start, e.time_range.end))
    starts = {k: [s for s, _ in v] for k, v in ranges.items()}

    def inside(key: str, t: float) -> bool:
        i = bisect.bisect_right(starts[key], t) - 1
        return i >= 0 and t <= ranges[key][i][1]

    dev_ids = {e.id for e in dev}
    runtime = {e.id: e for e in cpu if e.name.startswith("cu") and e.id in dev_ids}
    matched = {"launch": 0, "time": 0}
    anchors = []
    for e in dev:
        r = runtime.get(e.id)
        matched["launch" if r is not None else "time"] += 1
        anchors.append(r.time_range.start if r is not None else e.time_range.start)

    phases: dict[str, dict] = {}
    text = [f"Tidal: one profiled iteration, {'CPU + CUDA' if cuda else 'CPU'} activities; per range the events "
            f"inside it (see analyze_profile in bench/e2e_grpo.py); times in the tables are the profiler's.\n"]
    for key in ranges:
        host = [e for e in cpu if inside(key, e.time_range.start)]
        mine = [e for e, t in zip(dev, anchors) if inside(key, t)]
        wall_us = sum(b - a for a, b in ranges[key])
        kernels = [e for e in mine if not _is_copy(e.name)]
        copies = [e for e in mine if _is_copy(e.name)]
        calls: dict[str, int] = {}
        for e in host:
            if e.name.startswith("cu"):
                calls[e.name] = calls.get(e.name, 0) + 1
        launch_calls = {n: c for n, c in calls.items() if "Launch" in n}
        sync_calls = {n: c for n, c in calls.items() if "Synchronize" in n or n in SYNC_CALLS}
        by_kernel: dict[str, list] = {}
        for e in kernels:
            slot = by_kernel.setdefault(e.name, [0, 0.0])
            slot[0] += 1
            slot[1] += (e.time_range.end - e.time_range.start) / 1e6
        by_op: dict[str, list] = {}
        for e in host:
            if is_range(e):
                continue
            slot = by_op.setdefault(e.name, [0, 0.0])
            slot[0] += 1
            slot[1] += e.self_cpu_time_total / 1e6
        busy_s = _interval_union([(e.time_range.start, e.time_range.end) for e in mine]) / 1e6
        ph = {
            "entries": len(ranges[key]), "wall_s": wall_us / 1e6, "timer_s": None,
            "host_events": len(host),
            # host time on the range's own thread outside any recorded op: Python, or waiting (e.g. for the autograd thread)
            "range_self_cpu_s": sum(e.self_cpu_time_total for e in host if is_range(e) and (
                e.name == ITERATION_RANGE if key == ITERATION_RANGE else e.name == PHASE_RANGE + key)) / 1e6,
            "top_cpu_ops": [[n, c, t] for n, (c, t) in sorted(by_op.items(), key=lambda kv: -kv[1][1])[:5]],
        }
        if cuda:
            ph.update({
                "device_kernel_s": sum(t for _, t in by_kernel.values()),
                "device_copy_s": sum((e.time_range.end - e.time_range.start) / 1e6 for e in copies),
                "device_busy_s": busy_s,
                "device_idle_frac": max(0.0, 1.0 - busy_s / (wall_us / 1e6)) if wall_us > 0 else None,
                "device_kernels": len(kernels), "device_copies": len(copies),
                "kernel_launches": sum(c for n, c in launch_calls.items() if "Graph" not in n),
                "graph_launches": sum(c for n, c in launch_calls.items() if "Graph" in n),
                "launch_calls": launch_calls,
                "host_syncs": sum(sync_calls.values()), "sync_calls": sync_calls,
                "memcpy_dtoh": sum(1 for e in copies if "DtoH" in e.name),
                "top_kernels": [[n, c, t] for n, (c, t) in sorted(by_kernel.items(), key=lambda kv: -kv[1][1])[:5]],
            })
        phases[key] = ph
        evl = EventList(host + mine, use_device="cuda" if cuda else None)
        evl._tree_built = True  # a subset of prof.events(), whose parent/child links are already built
        avg = evl.key_averages()
        head = (f"==== {key}: {ph['entries']} entr{'y' if ph['entries'] == 1 else 'ies'}, wall {1e3 * ph['wall_s']:.3f} ms, "
                f"{1e3 * ph['range_self_cpu_s']:.3f} ms of it outside ops on the range's thread")
        if cuda:
            head += (f"; device kernels {1e3 * ph['device_kernel_s']:.3f} ms, busy {1e3 * ph['device_busy_s']:.3f} ms "
                     f"(idle {100 * (ph['device_idle_frac'] or 0):.1f}%), {ph['device_kernels']} kernels, "
                     f"{ph['kernel_launches']} launch calls + {ph['graph_launches']} graph launches, "
                     f"{ph['host_syncs']} host syncs {sync_calls}, {ph['memcpy_dtoh']} DtoH copies")
        text.append(head + "\n")
        sorts = [("self_device_time_total", "self device time"), ("self_cpu_time_total", "self CPU time")] if cuda \
            else [("self_cpu_time_total", "self CPU time")]
        for sort_by, label in sorts:
            text.append(f"-- top {top} by {label} --\n")
            text.append(_avg_table(avg, sort_by, top, cuda) + "\n")
    summary = {
        "method": "record_function range per phase around the PhaseTimer hook; host events by start time, device "
                  "events by the time of their launching runtime call (CUPTI correlation id), else their own start",
        "events": len(events), "device_events": len(dev), "kernels_matched_by": matched,
        "phases": phases,
    }
    if cuda and not dev:
        summary["warning"] = "no device events recorded (CUPTI gave nothing): the device figures are zero"
    return summary, "\n".join(text)


def _avg_table(avg, sort_by: str, top: int, cuda: bool) -> str:
    """The ``top`` rows of ``key_averages()`` by ``sort_by``, in ms. Our own formatting: torch's
    ``EventList.table`` asserts when a subset's total device time is 0 but a row's is not (seen on
    torch 2.11 with a range's subset of events)."""
    cols = [("calls", lambda e: f"{e.count}")]
    if cuda:
        cols += [("self dev ms", lambda e: f"{e.self_device_time_total / 1e3:.3f}"),
                 ("dev ms", lambda e: f"{e.device_time_total / 1e3:.3f}")]
    cols += [("self cpu ms", lambda e: f"{e.self_cpu_time_total / 1e3:.3f}"),
             ("cpu ms", lambda e: f"{e.cpu_time_total / 1e3:.3f}")]
    rows = sorted(avg, key=lambda e: -getattr(e, sort_by))[:top]
    lines = ["  ".join([f"{'name':<100}"] + [f"{c:>12}" for c, _ in cols])]
    for e in rows:
        lines.append("  ".join([f"{e.key[:100]:<100}"] + [f"{f(e):>12}" for _, f in cols]))
    return "\n".join(lines)


# ---- TRL worker ------------------------------------------------------------------------------------
def worker_trl(spec: dict, sink: Sink) -> None:
    """Run TRL's GRPOTrainer for warm-up + timed steps; a callback times each optimizer step."""
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
    s = BenchSettings(**spec["settings"])
    tokenizer = AutoTokenizer.from_pretrained(spec["tokenizer_dir"])
    t0 = time.perf_counter()
    trainer, gen_log = _build_trl(spec, s, tokenizer, cuda, sink)
    sink.write({"kind": "init", "init_s": time.perf_counter() - t0,
                "config": {k: v for k, v in trainer.args.to_dict().items() if isinstance(v, (int, float, str, bool, type(None)))}})
    trainer.train()
    sink.write({"kind": "done", "peak_allocated": torch.cuda.max_memory_allocated() if cuda else None,
                "peak_reserved": torch.cuda.max_memory_reserved() if cuda else None, "generate_calls": len(gen_log)})


def _build_trl(spec: dict, s: BenchSettings, tokenizer, cuda: bool, sink: Sink):
    import datasets
    from trl import GRPOConfig, GRPOTrainer

    rows = [json.loads(line) for line in open(spec["data"])]
    ga = s.seqs // s.trl_micro_batch
    args = GRPOConfig(
        output_dir=spec["run_dir"], report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True,
        max_steps=s.trl_warmup + s.trl_steps, seed=s.seed, learning_rate=s.lr, max_grad_norm=1.0,
        per_device_train_batch_size=s.trl_micro_batch, gradient_accumulation_steps=ga, steps_per_generation=ga,
        num_generations=s.samples, num_iterations=1, max_completion_length=s.new_tokens, temperature=1.0,
        generation_kwargs={"min_new_tokens": s.new_tokens}, beta=KL_COEF if spec["kl"] else 0.0,
        gradient_checkpointing=s.trl_gradient_checkpointing, bf16=cuda, use_cpu=not cuda, dataloader_num_workers=0,
        model_init_kwargs={"dtype": s.trl_dtype},
    )
    trainer = GRPOTrainer(model=spec["model_dir"], reward_funcs=trl_reward, args=args,
                          train_dataset=datasets.Dataset.from_list(rows), processing_class=tokenizer)
    gen_log: list[dict] = []
    _wrap_hf_generate(trainer.model, gen_log, cuda)
    trainer.add_callback(_trl_step_callback(sink, gen_log, spec["deadline"], cuda))
    return trainer, gen_log


def _wrap_hf_generate(model, gen_log: list[dict], cuda: bool) -> None:
    import torch

    orig = model.generate

    def generate(*args, **kwargs):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = orig(*args, **kwargs)
        if cuda:
            torch.cuda.synchronize()
        ids = kwargs.get("input_ids", args[0] if args else None)
        gen_log.append({"seconds": time.perf_counter() - t0, "batch": int(out.shape[0]),
                        "prompt_len": int(ids.shape[1]) if ids is not None else None,
                        "new_tokens": int(out.shape[1] - ids.shape[1]) if ids is not None else None})
        return out

    model.generate = generate


def _trl_step_callback(sink: Sink, gen_log: list[dict], deadline: float, cuda: bool):
    import torch
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        """Wall time between consecutive optimizer-step ends (everything the loop does per iteration)."""

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


WORKERS = {"setup": worker_setup, "tidal": worker_tidal, "trl": worker_trl}


def run_worker(name: str, spec_path: str) -> int:
    """Entry of a worker subprocess: read its spec, write records to the spec's result file."""
    spec = json.load(open(spec_path))
    sink = Sink(spec["result_file"])
    try:
        WORKERS[name](spec, sink)
    except BaseException as e:  # the parent reports it as an error figure
        import traceback

        sink.write({"kind": "error", "message": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]})
        return 1
    return 0


# ---- parent: cases, subprocesses, figures ----------------------------------------------------------
@dataclasses.dataclass(kw_only=True, frozen=True)
class Case:
    framework: str
    size: str
    kl: bool

    @property
    def name(self) -> str:
        return f"{self.framework}-{self.size}-kl{'on' if self.kl else 'off'}"


def plan_cases(frameworks: list[str], sizes: list[str], kls: list[bool]) -> list[Case]:
    """Cases in priority order: by level (size index + KL on), Tidal before TRL within a level, then
    the first size first: 0.5b off (tidal, trl), then tidal 0.5b on, tidal 1.5b off, trl 0.5b on, ..."""
    cases = [Case(framework=f, size=z, kl=k) for f in frameworks for z in sizes for k in kls]
    rank = {z: i for i, z in enumerate(sizes)}
    return sorted(cases, key=lambda c: (rank[c.size] + int(c.kl), c.framework != "tidal", rank[c.size], c.kl))


class Run:
    """The parent: owns the deadline, the work dir, the printed figures and the raw records."""

    def __init__(self, args, settings: BenchSettings):
        self.args = args
        self.settings = settings
        self.t_start = time.time()
        self.deadline = self.t_start + args.time_budget_s
        self.work_dir = args.work_dir or os.path.join(tempfile.gettempdir(), "tidal-e2e-grpo")
        os.makedirs(self.work_dir, exist_ok=True)
        self.run_id = uuid.uuid4().hex[:12]
        self.figures: list[dict] = []
        self.raw: list[dict] = []
        self.models: dict[str, dict] = {}
        self.ceilings: dict | None = None
        self.env: dict = {}
        self.results: dict[Case, dict] = {}
        self.profile_case: Case | None = None  # --profile: the first Tidal case (set by main)

    def emit(self, figure: str, **fields) -> None:
        rec = _rounded({"figure": figure, **fields})
        print(json.dumps(rec, default=_json_default), flush=True)
        self.figures.append(rec)

    def spawn(self, worker: str, spec: dict, timeout_s: float, tag: str) -> tuple[list[dict], int | None, str]:
        """Run a worker to completion or ``timeout_s`` (then killed); returns its records, rc and log tail."""
        result_file = os.path.join(self.work_dir, f"{tag}-{self.run_id}.jsonl")
        log_file = os.path.join(self.work_dir, f"{tag}-{self.run_id}.log")
        spec = {**spec, "result_file": result_file, "device": self.args.device, "work_dir": self.work_dir,
                "settings": dataclasses.asdict(self.settings)}
        spec_file = os.path.join(self.work_dir, f"{tag}-{self.run_id}.spec.json")
        json.dump(spec, open(spec_file, "w"))
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": os.pathsep.join([REPO, HERE, os.environ.get("PYTHONPATH", "")])}
        if self.args.device == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""
        rc = None
        with open(log_file, "w") as log:
            proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", worker, spec_file],
                                    stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
            try:
                rc = proc.wait(timeout=max(1.0, timeout_s))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()
        tail = _tail(log_file, 1500)
        self._keep_log(tag, log_file)
        records = read_records(result_file)
        self.raw.extend({"case": tag, **r} for r in records)
        return records, rc, tail

    def _keep_log(self, tag: str, log_file: str) -> None:
        if self.args.out_dir:
            with open(os.path.join(self.args.out_dir, "logs.txt"), "a") as out, open(log_file) as src:
                out.write(f"===== {tag} =====\n{src.read()}\n")

    # ---- stages ------------------------------------------------------------------------------------
    def setup(self, sizes: list[str]) -> bool:
        records, rc, tail = self.spawn("setup", {"sizes": sizes}, self.remaining(), "setup")
        for r in records:
            if r["kind"] == "env":
                self.env = {k: v for k, v in r.items() if k != "kind"}
                self.emit("env", commit=self.args.commit, **self.env, settings=dataclasses.asdict(self.settings),
                          tidal_set=self.args.tidal_set, time_budget_s=self.args.time_budget_s)
            elif r["kind"] == "model":
                self.models[r["size"]] = r
                self.emit("model", size=r["size"], params=r["params"], params_formula=r["params_formula"],
                          kv_bytes_per_token=kv_bytes_per_token(r["shape"]))
            elif r["kind"] == "ceilings":
                self.ceilings = r
                self.emit("ceilings", copy_bw_GBps=r["copy_bw"] / 1e9, bf16_matmul_TFLOPs=r["matmul_flops"] / 1e12)
        errors = [r for r in records if r["kind"] == "error"]
        if errors or rc != 0 or len(self.models) != len(sizes):
            self.emit("error", stage="setup", rc=rc, message=errors[0]["message"] if errors else "setup did not finish",
                      log_tail=tail)
            return False
        return True

    def remaining(self) -> float:
        return self.deadline - time.time()

    def run_case(self, case: Case) -> None:
        cap = CASE_CAP_S.get((case.framework, case.size), 600)
        profiled = case == self.profile_case
        if profiled:
            cap += PROFILE_EXTRA_S
        budget = min(self.remaining(), cap)
        if budget < (CASE_MIN_S if not self.args.tiny else 5):
            self.emit("skipped", case=case.name, reason=f"time budget: {self.remaining():.0f} s left")
            return
        model = self.models[case.size]
        spec = {"framework": case.framework, "size": case.size, "kl": case.kl, "model_dir": model["model_dir"],
                "tokenizer_dir": model["tokenizer_dir"], "data": model["data"], "run_dir": os.path.join(self.work_dir, f"run-{case.name}-{self.run_id}"),
                "deadline": time.time() + budget - 10, "tidal_set": self.args.tidal_set}
        if profiled:
            spec["profile"] = {"dir": os.path.abspath(self.args.profile), "trace_max_mb": self.args.profile_trace_mb}
        records, rc, tail = self.spawn(case.framework, spec, budget, case.name)
        summarize = summarize_tidal if case.framework == "tidal" else summarize_trl
        summary = summarize(records, self.settings, kl=case.kl)
        summary.update(rc=rc)
        self.results[case] = summary
        if profiled and summary.get("profile") is None:
            summary["profile"] = {"error": "the worker left no profile record (killed or failed first: see the case's "
                                           "error line / logs.txt)"}
        self.report_case(case, summary, tail)

    # ---- figures -----------------------------------------------------------------------------------
    def report_case(self, case: Case, sm: dict, tail: str) -> None:
        base = {"framework": case.framework, "size": case.size, "kl": case.kl}
        if sm.get("error") or not sm["steady_s"]:
            self.emit("error", **base, rc=sm["rc"], message=sm.get("error") or "no timed iteration finished",
                      steps_s=sm["steps_s"], log_tail=tail)
            if not sm["steady_s"]:
                return
        self.emit("iteration", **base, median_s=median_or_none(sm["steady_s"]), steady_s=sm["steady_s"],
                  warmup_s=sm["warmup_s"], init_s=sm.get("init_s"), stopped_early=sm["stopped_early"],
                  checks_ok=all(sm["checks"].values()), checks=sm["checks"])
        self.emit("peak_memory", **base, allocated_gib=_gib(sm["peak_allocated"]), reserved_gib=_gib(sm["peak_reserved"]))
        bounds = self.bounds(case, old_logprobs="actor_logprobs" in sm["phases"])
        for phase, seconds in sm["phases"].items():
            bound = bounds.get(phase)
            self.emit("phase", **base, phase=phase, median_s=seconds, bound_s=bound,
                      bound_over_measured=(bound / seconds) if bound and seconds else None)
        if case.framework == "tidal":
            self.report_tidal_extras(case, base, sm, bounds)
        self.report_ratio(case)

    def bounds(self, case: Case, *, old_logprobs: bool) -> dict[str, float]:
        if self.ceilings is None:
            return {}
        m = self.models[case.size]
        return phase_bounds(n_params=m["params"], shape=m["shape"], s=self.settings, kl=case.kl,
                            copy_bw=self.ceilings["copy_bw"], matmul_flops=self.ceilings["matmul_flops"],
                            old_logprobs=old_logprobs)

    def report_tidal_extras(self, case: Case, base: dict, sm: dict, bounds: dict) -> None:
        measured = median_or_none(sm["steady_s"])
        if bounds:
            total = sum(bounds.values())
            self.emit("iteration_bound", **base, bound_s=total, parts_s=bounds, measured_s=measured,
                      bound_over_measured=total / measured if measured else None)
        ws = sm["weight_sync"]
        if ws["seconds"]:
            copy_bw = self.ceilings["copy_bw"] if self.ceilings else None
            t = statistics.median(ws["seconds"])
            self.emit("weight_sync", **base, bytes=ws["bytes"], median_s=t, GBps=ws["bytes"] / t / 1e9 if ws["bytes"] else None,
                      copy_bw_GBps=copy_bw / 1e9 if copy_bw else None, bound_s=bounds.get("weight_sync"),
                      bound_over_measured=bounds["weight_sync"] / t if bounds else None)
        if sm.get("engine_host"):
            self.emit("engine_host", **base, unit="host ms per engine step (median over steady iterations)",
                      **sm["engine_host"])
        if sm.get("profile"):
            self.report_profile(base, sm)
        if sm["timeline"]:
            self.emit("memory_timeline", **base, step=sm["timeline_step"],
                      unit="GiB allocated, GiB reserved (torch allocator), GiB used on the device (driver: all memory, "
                           "incl. the engine's fixed-address KV cache), [GiB peak allocated in the phase]",
                      points=[[p["label"], _gib(p["allocated"]), _gib(p["reserved"]), _gib(p.get("device_used"))]
                              + ([_gib(p["peak"])] if p.get("peak") else [])
                              for p in sm["timeline"]],
                      returned_bytes={c["name"]: c["returned"] for c in sm["timeline_calls"] if c["returned"] is not None})

    def report_profile(self, base: dict, sm: dict) -> None:
        """The "profile" figure: per phase of the profiled iteration its wall time (and the unprofiled
        median), device-kernel time, idle fraction, launches, host syncs and top kernel; the full
        tables are in the profile folder."""
        prof = sm["profile"]
        if prof.get("error"):
            self.emit("profile", **base, dir=prof.get("dir") or self.args.profile, error=prof["error"])
            return
        phases = {}
        for name, ph in prof["phases"].items():
            top = (ph.get("top_kernels") or ph.get("top_cpu_ops") or [None])[0]
            phases[name] = {
                "wall_s": ph["wall_s"], "timer_s": ph.get("timer_s"),
                "unprofiled_median_s": median_or_none(sm["steady_s"]) if name == ITERATION_RANGE else sm["phases"].get(name),
                "outside_ops_s": ph.get("range_self_cpu_s"),
                **{k: ph.get(k) for k in ("device_kernel_s", "device_idle_frac", "kernel_launches", "graph_launches",
                                          "host_syncs", "memcpy_dtoh") if k in ph},
                "top": [top[0][:80], top[1], top[2]] if top else None,
            }
        trace = prof.get("trace") or {"kept": False, "reason": "not written (worker stopped first)"}
        files = list(prof.get("files", [])) + (["trace.json.gz"] if trace.get("kept") else [])
        self.emit("profile", **base, dir=prof["dir"], step=prof.get("step"), files=files,
                  trace_mib=(trace["bytes"] / 2**20) if trace.get("bytes") else None,
                  trace_note=None if trace.get("kept") else trace.get("reason"),
                  events=prof.get("events"), device_events=prof.get("device_events"),
                  kernels_matched_by=prof.get("kernels_matched_by"), warning=prof.get("warning"),
                  postprocess_s=prof.get("postprocess_s"), phases=phases)

    def report_ratio(self, case: Case) -> None:
        tidal = self.results.get(Case(framework="tidal", size=case.size, kl=case.kl))
        trl = self.results.get(Case(framework="trl", size=case.size, kl=case.kl))
        if not (tidal and trl and tidal["steady_s"] and trl["steady_s"]):
            return
        a, b = median_or_none(trl["steady_s"]), median_or_none(tidal["steady_s"])
        mem_a, mem_b = trl["peak_allocated"], tidal["peak_allocated"]
        self.emit("ratio", size=case.size, kl=case.kl, trl_s=a, tidal_s=b, trl_over_tidal=a / b,
                  trl_peak_gib=_gib(mem_a), tidal_peak_gib=_gib(mem_b),
                  memory_trl_over_tidal=(mem_a / mem_b) if mem_a and mem_b else None)

    def finish(self, cases: list[Case]) -> None:
        main_tidal = self.results.get(Case(framework="tidal", size="0.5b", kl=False))
        main_trl = self.results.get(Case(framework="trl", size="0.5b", kl=False))
        t = median_or_none(main_tidal["steady_s"]) if main_tidal else None
        r = median_or_none(main_trl["steady_s"]) if main_trl else None
        table = {c.name: {"median_s": median_or_none(sm["steady_s"]), "n": len(sm["steady_s"]),
                          "peak_gib": _gib(sm["peak_allocated"]), "checks_ok": all(sm["checks"].values()),
                          "error": bool(sm.get("error"))} for c, sm in self.results.items()}
        self.emit("summary", elapsed_s=time.time() - self.t_start, cases_run=[c.name for c in cases if c in self.results],
                  cases_planned=[c.name for c in cases], cases=table, tidal_main_s=t, trl_main_s=r,
                  target_tidal_le_1s=(t <= 1.0) if t is not None else None,
                  target_ratio_ge_8=(r / t >= 8) if (t and r) else None)
        self.write_outputs()

    def write_outputs(self) -> None:
        stamp = {"run_id": self.run_id, "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "commit": self.args.commit,
                 "device": self.env.get("device"), "settings": dataclasses.asdict(self.settings), "tidal_set": self.args.tidal_set}
        if self.args.record:
            os.makedirs(os.path.dirname(os.path.abspath(self.args.record)), exist_ok=True)
            with open(self.args.record, "a") as f:
                for rec in self.figures:
                    f.write(json.dumps({**stamp, **rec}, default=_json_default) + "\n")
        if self.args.out_dir:
            with open(os.path.join(self.args.out_dir, "raw.jsonl"), "a") as f:
                for rec in self.raw:
                    f.write(json.dumps({"run_id": self.run_id, **rec}, default=_json_default) + "\n")


def _steps_split(steps: list[dict], warmup: int) -> tuple[list[dict], list[dict]]:
    steps = sorted(steps, key=lambda r: r["step"])
    return steps[:warmup], steps[warmup:]


def summarize_tidal(records: list[dict], s: BenchSettings, kl: bool = False) -> dict:
    """Aggregate a Tidal worker's records: steady iterations, phase medians, peaks, timeline, checks."""
    init = next((r for r in records if r["kind"] == "init"), {})
    warm, steady = _steps_split([r for r in records if r["kind"] == "step"], s.tidal_warmup)
    phase_names = sorted({k[5:] for r in steady for k in r["metrics"] if k.startswith("time/") and k != "time/step"})
    phases = {p: statistics.median([r["metrics"].get(f"time/{p}", 0.0) for r in steady]) for p in phase_names}
    all_steps = warm + steady
    peaks = [init.get("peak_allocated")] + [r["peak_allocated"] for r in all_steps]
    peaks_r = [init.get("peak_reserved")] + [r["peak_reserved"] for r in all_steps]
    syncs = [c for r in steady for c in r["calls"] if c["name"].startswith("update_engine_weights")]
    checks = {
        "prompt_len": init.get("prompt_lens") == [s.prompt_len],
        "completions_per_rollout": all(r["generate"] and r["generate"]["completions"] == s.seqs for r in all_steps),
        "completion_tokens_forced": all(r["generate"] and r["generate"]["min_len"] == s.new_tokens == r["generate"]["max_len"]
                                        for r in all_steps),
        "response_length_metric": all(abs(r["metrics"].get("response/length_mean", -1) - s.new_tokens) < 1e-6 for r in all_steps),
        "finite_rewards": all(math.isfinite(r["metrics"].get("reward/mean", math.nan)) for r in all_steps),
        "one_optimizer_step": all(r["metrics"].get("actor/skipped", 0.0) == 0.0 for r in all_steps),
        "reference_model_iff_kl": bool(all_steps) and all(("actor/kl" in r["metrics"]) == kl for r in all_steps),
    }
    last = steady[-1] if steady else (warm[-1] if warm else None)
    return {
        "error": _first_error(records), "init_s": init.get("init_s"),
        "warmup_s": [r["wall_s"] for r in warm], "steady_s": [r["wall_s"] for r in steady],
        "steps_s": [r["wall_s"] for r in all_steps], "phases": phases, "checks": checks,
        "stopped_early": any(r["kind"] == "stopped" for r in records),
        "peak_allocated": max((p for p in peaks if p is not None), default=None),
        "peak_reserved": max((p for p in peaks_r if p is not None), default=None),
        "weight_sync": {"bytes": syncs[-1]["returned"] if syncs else None, "seconds": [c["seconds"] for c in syncs]},
        "engine_host": engine_host_ms(steady),
        "timeline": last["timeline"] if last else [], "timeline_calls": last["calls"] if last else [],
        "timeline_step": last["step"] if last else None,
        "profile": _profile_of(records),
    }


def engine_host_ms(steps: list[dict]) -> dict | None:
    """Median over ``steps`` of the native engine's host milliseconds per engine step (prefill and
    decode) for each of its host timers (schedule, postprocess, prepare, submit, wait), from the
    engine's cumulative ``stats``; None for an engine without them. ``wait`` is host time blocked on
    the device: the rest is host work that the device waits for unless it overlaps a step in flight."""
    per_step: dict[str, list[float]] = {}
    for r in steps:
        e = r.get("engine") or {}
        n = e.get("decode_steps", 0) + e.get("prefill_steps", 0)
        if not n:
            continue
        for k, v in e.items():
            if k.endswith("_s"):
                per_step.setdefault(k[:-2], []).append(1e3 * v / n)
        per_step.setdefault("engine_steps", []).append(n)
    return {k: round(statistics.median(v), 4) for k, v in per_step.items()} or None


def _profile_of(records: list[dict]) -> dict | None:
    """The profiled iteration's record (with its trace's, if any), or None when none was profiled."""
    prof = next((r for r in records if r["kind"] == "profile"), None)
    trace = next((r for r in records if r["kind"] == "profile_trace"), None)
    if prof is None:
        return None
    prof = {k: v for k, v in prof.items() if k != "kind"}
    if trace is not None:
        prof["trace"] = {k: v for k, v in trace.items() if k != "kind"}
    return prof


def summarize_trl(records: list[dict], s: BenchSettings, kl: bool = False) -> dict:
    """Aggregate a TRL worker's records: steady optimizer steps, generate time, peaks, checks."""
    init = next((r for r in records if r["kind"] == "init"), {})
    done = next((r for r in records if r["kind"] == "done"), {})
    warm, steady = _steps_split([r for r in records if r["kind"] == "step"], s.trl_warmup)
    all_steps = warm + steady
    logs = [r["logs"] for r in records if r["kind"] == "log" and "completions/mean_length" in r["logs"]]
    gens = [g for r in all_steps for g in r["generate"]]
    checks = {
        "one_generation_per_step": all(len(r["generate"]) == 1 for r in all_steps) if all_steps else False,
        "completions_per_generation": bool(gens) and all(g["batch"] == s.seqs for g in gens),
        "prompt_len": bool(gens) and all(g["prompt_len"] == s.prompt_len for g in gens),
        "completion_tokens_forced": bool(logs) and all(
            lg.get("completions/min_length") == lg.get("completions/max_length") == s.new_tokens for lg in logs),
        "reference_model_iff_kl": bool(logs) and all(("kl" in lg) == kl for lg in logs),
    }
    peak = done.get("peak_allocated") or max((r["peak_allocated"] for r in all_steps if r["peak_allocated"]), default=None)
    return {
        "error": _first_error(records), "init_s": init.get("init_s"),
        "warmup_s": [r["wall_s"] for r in warm], "steady_s": [r["wall_s"] for r in steady],
        "steps_s": [r["wall_s"] for r in all_steps], "checks": checks,
        "phases": {"generate": statistics.median([r["generate_s"] for r in steady])} if steady else {},
        "stopped_early": any(r["kind"] == "stopped" for r in records),
        "peak_allocated": peak, "peak_reserved": done.get("peak_reserved"),
    }


def _first_error(records: list[dict]) -> str | None:
    """The first error's message and the end of its traceback (the whole one is in raw.jsonl)."""
    err = next((r for r in records if r["kind"] == "error"), None)
    if err is None:
        return None
    return err["message"] + ("\n..." + err["traceback"][-900:] if err.get("traceback") else "")


def _rounded(x, digits: int = 4):
    """Floats to ``digits`` significant digits, recursively (keeps the printed lines short)."""
    if isinstance(x, float):
        return float(f"{x:.{digits}g}") if math.isfinite(x) else x
    if isinstance(x, dict):
        return {k: _rounded(v, digits) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_rounded(v, digits) for v in x]
    return x


def _gib(x):
    return None if x is None else round(x / GIB, 3)


def _json_default(o):
    return str(o)


def _tail(path: str, n: int) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:]
    except OSError:
        return ""


def git_commit() -> str:
    if os.environ.get("TIDAL_COMMIT"):
        return os.environ["TIDAL_COMMIT"]
    try:
        return subprocess.check_output(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], text=True,
                                       stderr=subprocess.DEVNULL).strip()
    except Exception:
        return "unknown"


# ---- CLI -------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", choices=["tidal", "trl"], help="run one framework only")
    p.add_argument("--sizes", default="0.5b,1.5b", help="comma list of 0.5b,1.5b (first = main)")
    p.add_argument("--kl", choices=["off", "on", "both"], default="both", help="KL-off cases, KL-on cases, or both")
    p.add_argument("--time-budget-s", type=float, default=480.0, help="the whole run stops cleanly within this")
    p.add_argument("--record", nargs="?", const=DEFAULT_RECORD, default=None,
                   help=f"append the figures (with commit, device, settings) to PATH (default {DEFAULT_RECORD})")
    p.add_argument("--out-dir", default=None, help="also write raw.jsonl (every worker record) and logs.txt (worker output) here")
    p.add_argument("--work-dir", default=None, help="model folders, prompts, worker files (default: $TMPDIR/tidal-e2e-grpo)")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny model, 2 prompts x 2 samples, 8 tokens")
    p.add_argument("--tidal-set", action="append", default=[], metavar="KEY=VALUE", help="override a Tidal config key")
    p.add_argument("--trl-micro-batch", type=int, default=None, help="completions per TRL forward/backward (default 32)")
    p.add_argument("--trl-dtype", choices=["float32", "bfloat16"], default="float32",
                   help="TRL model_init dtype (float32 = fp32 master weights + bf16 autocast, like Tidal)")
    p.add_argument("--trl-gradient-checkpointing", action="store_true", help="TRL with gradient checkpointing (its default)")
    p.add_argument("--steps", type=int, default=None, help="timed iterations of each case (default Tidal 5, TRL 3)")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="profile one extra Tidal iteration of the main case (after the timed ones) with torch.profiler; "
                        "write phases.txt, summary.json and trace.json.gz into DIR")
    p.add_argument("--profile-trace-mb", type=float, default=TRACE_MAX_MB,
                   help=f"keep trace.json.gz only up to this size (default {TRACE_MAX_MB:g}; 0: no trace)")
    p.add_argument("--commit", default=None, help="commit recorded with the results (default: git or $TIDAL_COMMIT)")
    p.add_argument("--worker", nargs=2, metavar=("NAME", "SPEC"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not args.worker:
        args.commit = args.commit or git_commit()
    return args


def settings_of(args) -> BenchSettings:
    kw = dict(TINY) if args.tiny else {}
    if args.trl_micro_batch:
        kw["trl_micro_batch"] = args.trl_micro_batch
    if args.steps:
        kw["tidal_steps"] = kw["trl_steps"] = args.steps
    kw["trl_dtype"] = args.trl_dtype
    kw["trl_gradient_checkpointing"] = args.trl_gradient_checkpointing
    return BenchSettings(**kw)


def resolve_device(pref: str, tiny: bool) -> str:
    if pref != "auto":
        return pref
    if tiny:
        return "cpu"
    try:
        out = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
                             capture_output=True, text=True, timeout=120)
        return "cuda" if out.stdout.strip() == "True" else "cpu"
    except Exception:
        return "cpu"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return run_worker(*args.worker)
    settings = settings_of(args)
    args.device = resolve_device(args.device, args.tiny)
    if args.out_dir:
        os.makedirs(args.out_dir, exist_ok=True)
    sizes = ["tiny"] if args.tiny else [z.strip() for z in args.sizes.split(",") if z.strip()]
    bad = [z for z in sizes if z not in SHAPES]
    if bad:
        raise SystemExit(f"--sizes: unknown {bad}; known: {SIZE_ORDER}")
    frameworks = [args.only] if args.only else ["tidal", "trl"]
    run = Run(args, settings)
    if "trl" in frameworks and (importlib.util.find_spec("trl") is None or importlib.util.find_spec("datasets") is None):
        run.emit("error", framework="trl", message="trl/datasets are not installed: run bench/prepare_wheels.sh where pip "
                 "works, carry .whl, install with pip --target and PYTHONPATH (bench/README.md); TRL cases skipped")
        frameworks.remove("trl")
    kls = {"off": [False], "on": [True], "both": [False, True]}[args.kl]
    cases = plan_cases(frameworks, sizes, kls)
    if args.profile:
        run.profile_case = next((c for c in cases if c.framework == "tidal"), None)
        if run.profile_case is None:
            run.emit("profile", error="--profile needs a Tidal case: none is planned")
        else:
            os.makedirs(args.profile, exist_ok=True)
    if cases and run.setup(sizes):
        for case in cases:
            run.run_case(case)
    run.finish(cases)
    return 0


if __name__ == "__main__":
    sys.exit(main())
