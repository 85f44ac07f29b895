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

Incremental requests (optional, :class:`IncrementalEngine`; the native engine has it): ``add`` a
batch of :class:`Request`, call ``step`` until ``has_unfinished`` is False (each step returns the
completions that finished in it), and ``abort`` what is left to get partial completions back. A
request may carry tokens generated earlier (a partial completion, possibly under older weights):
they are prefilled again under the current weights and generation goes on after them. This is what
partial rollout (stop once enough groups are complete, resume the rest in the next iteration) and
multi-turn rollouts (the next turn joins while other sequences decode) are built on; the loop that
steps an engine until enough is done is :func:`tidal.engine.stepping.run_steps`. Callers check :func:`supports_incremental` first; an engine without it
gets a :class:`NotImplementedError` from :func:`require_incremental` that names the way out.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Iterable, Literal, Protocol, Sequence, runtime_checkable

import numpy as np
import torch

from tidal.config_base import check
from tidal.sampling_filter import SamplingFilter


@dataclasses.dataclass(kw_only=True, frozen=True)
class SamplingParams:
    """How to sample one request.

    temperature: 0 means greedy (argmax); logprobs are then those of the untempered softmax.
    top_p / top_k / min_p: nucleus / top-k / min-p filtering (1.0 / 0 / 0 disable). The returned
        logprobs are those of the processed distribution actually sampled from (:attr:`filter`, as
        :mod:`tidal.sampling_filter` defines it: temperature, top-k, min-p, top-p, renormalised); the
        trainer scores with the same definition, so rollout-vs-trainer mismatch is measured, and
        corrected, against the distribution that was sampled.
    n: completions per prompt; outputs are prompt-major (all n of prompt 0, then prompt 1, ...).
    ignore_eos: keep generating until max_new_tokens (benchmarks).
    seed: if set, sampling is reproducible for the same prompts and weights.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_new_tokens: int = 256
    n: int = 1
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self):
        check(self.temperature >= 0, "temperature", "must be >= 0")
        check(0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        check(self.top_k >= 0, "top_k", "must be >= 0 (0 disables)")
        check(0 <= self.min_p < 1, "min_p", "must be in [0, 1) (0 disables)")
        check(self.max_new_tokens >= 1, "max_new_tokens", "must be >= 1")
        check(self.n >= 1, "n", "must be >= 1")

    @property
    def filter(self) -> SamplingFilter:
        """The processed distribution these parameters sample from."""
        return SamplingFilter(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p)


def eos_ids(hf_config, model_dir: str | None = None) -> set[int]:
    """The model's end-of-sequence token ids, which a sequence stops at unless ``ignore_eos``: those
    of ``hf_config`` and of its text config (a vision-language config may keep them there only) and,
    given the model's folder ``model_dir``, those of its ``generation_config.json``."""
    values = [getattr(hf_config, "eos_token_id", None)]
    if hasattr(hf_config, "get_text_config"):
        values.append(getattr(hf_config.get_text_config(), "eos_token_id", None))
    gen_path = os.path.join(model_dir, "generation_config.json") if model_dir is not None else None
    if gen_path is not None and os.path.exists(gen_path):
        with open(gen_path) as f:
            values.append(json.load(f).get("eos_token_id"))
    return {int(v) for value in values if value is not None for v in (value if isinstance(value, (list, tuple)) else [value])}


FinishReason = Literal["stop", "length", "abort"]


@dataclasses.dataclass(kw_only=True)
class Completion:
    """One generated response. ``logprobs[i]`` is the sampling logprob of ``token_ids[i]``.

    finish_reason: ``stop`` (a stop token, included), ``length`` (max_new_tokens or the model's
        context), ``abort`` (unfinished: returned by ``abort``; resume it with :meth:`Request.resume`).
    request_id / group_id: those of the :class:`Request` (``generate`` numbers its sequences
        ``0..len(prompts)*n-1`` in output order and uses the prompt index as the group); None from
        engines without incremental requests.
    versions: ``versions[i]`` is the policy version that sampled ``token_ids[i]`` (tokens of a
        resumed request keep theirs; new ones get the engine's ``policy_version``); None from
        engines that do not track it (every token is then from the current weights).
    routed_experts: MoE models on the native engine: int16 ``[P + G - 1, L, K]`` (``P`` prompt, ``G``
        generated tokens), the ``K`` experts the router chose for every token the engine fed to the
        model (the prompt's and all but the last generated token), in each of the model's ``L`` MoE
        layers in layer order; -1 for a token whose routing is unknown. None for dense models and
        engines that do not record it. Routing replay (``moe.routing_replay``) trains with it.
    """

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    request_id: int | str | None = None
    group_id: int | None = None
    versions: list[int] | None = None
    routed_experts: "np.ndarray | None" = None

    @property
    def finished(self) -> bool:
        return self.finish_reason != "abort"


SAMPLES_PER_KEY_GROUP = 1 << 20  # sample indices a group's stream keys tell apart


def sequence_key(group_id: int, sample: int) -> int:
    """The stream key of sample ``sample`` of group ``group_id`` (:attr:`Request.key`): a sequence's
    random draws belong to its group and sample index, whatever the request carrying it (a
    multi-turn trajectory's turns, a partial rollout's carried sequence, a plain rollout's sample)."""
    if not 0 <= sample < SAMPLES_PER_KEY_GROUP:
        raise ValueError(f"sample index {sample} outside 0..{SAMPLES_PER_KEY_GROUP - 1}")
    return int(group_id) * SAMPLES_PER_KEY_GROUP + int(sample)


@dataclasses.dataclass(kw_only=True, frozen=True)
class Request:
    """One sequence to generate (a prompt with ``n`` samples is ``n`` requests sharing a group).

    request_id: the caller's name for it, returned on its completion (unique among the requests in
        flight). group_id: the GRPO group it belongs to (its prompt), or None.
    params: how to sample; ``n`` must be 1. ``max_new_tokens`` counts the resumed tokens too.
    mm_inputs: the prompt's pixel inputs (vision-language models), as in ``generate``. Requests
        added together that share the same dict object share the image features.
    token_ids / logprobs / versions: tokens generated earlier (a partial completion): prefilled again
        under the current weights, kept as they are in the completion (with their logprobs and
        versions), and generation continues after them. Empty for a fresh request.
    key: the key of its random stream: with ``params.seed``, the token at index ``i`` of its
        sequence is drawn with the uniform of (seed, key, i) (:func:`tidal.engine.sampler.keyed_uniforms`),
        whatever else is in flight. None: derived from ``request_id``. Callers give a sequence's
        :func:`sequence_key` so that every request continuing it draws from one stream.
    """

    request_id: int | str
    prompt_ids: list[int]
    params: SamplingParams
    group_id: int | None = None
    mm_inputs: dict | None = None
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    key: int | None = None

    def __post_init__(self):
        where = f"request {self.request_id!r}"
        if self.params.n != 1:
            raise ValueError(f"{where}: params.n must be 1 (a prompt with n samples is n requests), got {self.params.n}")
        if not self.prompt_ids:
            raise ValueError(f"{where}: prompt_ids is empty")
        if not len(self.token_ids) == len(self.logprobs) == len(self.versions):
            raise ValueError(f"{where}: token_ids, logprobs and versions must have one entry per resumed token, got "
                             f"{len(self.token_ids)}, {len(self.logprobs)}, {len(self.versions)}")
        if len(self.token_ids) >= self.params.max_new_tokens:
            raise ValueError(f"{where}: {len(self.token_ids)} resumed tokens leave nothing to generate under "
                             f"max_new_tokens={self.params.max_new_tokens}")

    @classmethod
    def resume(cls, completion: Completion, params: SamplingParams, mm_inputs: dict | None = None,
               key: int | None = None) -> "Request":
        """The request that continues an unfinished ``completion`` (``finish_reason == "abort"``);
        ``key``: its stream key (that of the request it continues, when that one had one)."""
        if completion.finished:
            raise ValueError(f"request {completion.request_id!r} finished ({completion.finish_reason}); only an aborted "
                             f"completion resumes")
        if completion.request_id is None or completion.versions is None:
            raise ValueError("Request.resume needs a completion with request_id and versions (from an incremental engine)")
        return cls(request_id=completion.request_id, prompt_ids=completion.prompt_ids, params=params,
                   group_id=completion.group_id, mm_inputs=mm_inputs, token_ids=list(completion.token_ids),
                   logprobs=list(completion.logprobs), versions=list(completion.versions), key=key)


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


@runtime_checkable
class IncrementalEngine(Protocol):
    """The optional request-level API (see the module docstring). Under tensor parallelism every TP
    rank calls the same methods with the same arguments in the same order, and gets the same results."""

    policy_version: int  # stamped on every token sampled from now on; set it after a weight sync

    def add(self, requests: Sequence[Request]) -> None:
        """Queue ``requests``; they are admitted by the following ``step`` calls."""

    def step(self) -> list[Completion]:
        """Run one engine step; returns the completions that finished in it."""

    def has_unfinished(self) -> bool:
        """Whether any added request has not finished (nor been aborted)."""

    def abort(self, request_ids: Iterable[int | str] | None = None) -> list[Completion]:
        """Stop the given requests (all unfinished ones when None); returns their partial completions
        (``finish_reason="abort"``: the tokens, logprobs and versions so far), in the order they were added."""


def supports_incremental(engine: RolloutEngine) -> bool:
    """Whether ``engine`` offers :class:`IncrementalEngine` (partial rollout, multi-turn requests)."""
    return isinstance(engine, IncrementalEngine)


def require_incremental(engine: RolloutEngine, what: str) -> IncrementalEngine:
    """``engine`` as an :class:`IncrementalEngine`, or NotImplementedError naming ``what`` needs it."""
    if not supports_incremental(engine):
        raise NotImplementedError(
            f"{what} needs incremental requests (add/step/abort), which {type(engine).__name__} does not offer; "
            f"use engine.backend=native"
        )
    return engine
