"""The rollout-engine contract every backend (native, hf, vllm, sglang) implements.

An engine lives inside the training process. It owns no process group of its own: when it needs
tensor parallelism it receives the rollout TP group from :mod:`tidal.distributed`. It knows nothing
about rewards, advantages or the trainer.

Weight names passed to :meth:`RolloutEngine.load_weights` are Hugging Face names of the actor
(``model.layers.0.self_attn.q_proj.weight``); the engine's model modules map them to their own layout.

Vision-language prompts: an engine that supports images (``native``, ``hf``) also takes
``generate(prompts, params, mm_inputs=[...])``, one pixel-input dict per prompt (None for text,
see :mod:`tidal.models.vision`), the prompt ids already holding the image tokens. Callers pass
``mm_inputs`` only when some prompt has images; :func:`tidal.engine.factory.create_engine` refuses
a vision-language model for a backend without image support.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Literal, Protocol, runtime_checkable

import torch

from tidal.config_base import check


@dataclasses.dataclass(kw_only=True, frozen=True)
class SamplingParams:
    """How to sample one request.

    temperature: 0 means greedy (argmax); logprobs are then those of the untempered softmax.
    top_p / top_k: nucleus / top-k filtering (1.0 / 0 disable). The returned logprobs are those of
        the processed distribution actually sampled from (after temperature, top-k and top-p,
        renormalised), so that rollout-vs-trainer mismatch can be corrected exactly.
    n: completions per prompt; outputs are prompt-major (all n of prompt 0, then prompt 1, ...).
    ignore_eos: keep generating until max_new_tokens (benchmarks).
    seed: if set, sampling is reproducible for the same prompts and weights.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    n: int = 1
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self):
        check(self.temperature >= 0, "temperature", "must be >= 0")
        check(0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        check(self.top_k >= 0, "top_k", "must be >= 0 (0 disables)")
        check(self.max_new_tokens >= 1, "max_new_tokens", "must be >= 1")
        check(self.n >= 1, "n", "must be >= 1")


@dataclasses.dataclass(kw_only=True)
class Completion:
    """One generated response. ``logprobs[i]`` is the sampling logprob of ``token_ids[i]``."""

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: Literal["stop", "length"]


@runtime_checkable
class RolloutEngine(Protocol):
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """Generate ``params.n`` completions for every prompt (prompt-major order)."""

    def sleep(self, level: int = 1) -> int:
        """Free memory: level 1 frees the KV cache (and CUDA graphs); level 2 also moves weights to CPU.
        Returns the number of device bytes freed."""

    def wake_up(self) -> int:
        """Restore what sleep freed (never syncs weights). Returns device bytes restored."""

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named full tensors into the engine's weights in place."""

    def memory_report(self) -> dict[str, int]:
        """Device bytes held now, by kind (weights, kv_cache, graphs, ...)."""

    # Optional: ``verify_weights(named_tensors) -> list[str]``, the names whose values in the engine
    # differ from the given full tensors (weight-sync verification, ``sync.verify``).
