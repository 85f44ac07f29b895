"""Configuration of the run's numerics (``numerics.*``): exact mode, in which the rollout's
logprobs equal the trainer's bit for bit (docs/exact.md; the ops: :mod:`tidal.exact`).

A section of its own because the switch belongs to neither side alone: it changes the native
engine's kernels and the trainer's forward together, and only together does it mean anything.
"""

from __future__ import annotations

import dataclasses

from tidal.config_base import ConfigError, check


@dataclasses.dataclass(kw_only=True)
class NumericsConfig:
    """``numerics.*``.

    exact: exact mode. The native engine and the trainer's actor forward run batch-invariant ops
        (:mod:`tidal.exact`): a token's logprob does not depend on the batch, the packing, chunked
        prefill or prefix hits, so the rollout's logprobs equal the trainer's old logprobs bit for
        bit (``mismatch/abs_logp_diff_mean`` is exactly 0) and the importance ratio of the first
        update epoch's first step is exactly 1. Costs compute (measured in docs/exact.md). Needs
        ``engine.backend: native``, ``engine.tp_size: 1``, ``engine.speculative: off``, no LoRA,
        ``rollout.partial`` off, the engine computing in the trainer's dtype, and a
        model family exact mode covers (:func:`check_exact_model`).
    """

    exact: bool = False


def check_exact(cfg) -> None:
    """The settings exact mode cannot be bitwise with (``cfg``: the root config), each a ConfigError
    that says what to do. Nothing when ``numerics.exact`` is off."""
    if not cfg.numerics.exact:
        return
    why = "numerics.exact needs"
    check(cfg.engine.backend == "native", "engine.backend", f"{why} engine.backend: native (exact mode runs the native engine's "
          f"batch-invariant kernels; {cfg.engine.backend} has its own); set engine.backend: native or numerics.exact: false")
    check(cfg.engine.tp_size == 1, "engine.tp_size", f"{why} engine.tp_size: 1 (a tensor-parallel all-reduce sums the shards "
          "in an order the trainer does not reproduce); set engine.tp_size: 1 or numerics.exact: false")
    check(cfg.engine.speculative == "off", "engine.speculative", f"{why} engine.speculative: off (verifying drafts scores "
          "several positions per step through the acceptance test, not the exact log-softmax)")
    check(cfg.engine.kernel_backend == "auto", "engine.kernel_backend", f"{why} engine.kernel_backend: auto (exact mode "
          "chooses the engine's kernels itself)")
    check(not cfg.model.lora.enabled, "model.lora.rank", f"{why} model.lora.rank: 0 (the engine runs the merged weights "
          "W + BA, the trainer x W + (x A) B: another sum); train the whole model or set numerics.exact: false")
    check(not cfg.rollout.partial.enabled, "rollout.partial.enabled", f"{why} rollout.partial off (a carried sequence's "
          "first tokens were sampled by older weights: their logprobs cannot equal the current actor's)")
    if cfg.task.name:  # a task's model is built at the first run: its family is task.architecture's
        from tidal.families import families

        family = {f.name: f for f in families()}.get(cfg.task.architecture)
        check(family is None or family.exact, "task.architecture", f"exact mode does not cover {cfg.task.architecture!r} "
              "yet (docs/exact.md); choose another architecture or set numerics.exact: false")
    engine_dtype, train_dtype = cfg.engine.dtype, cfg.strategy.param_dtype
    check(engine_dtype == train_dtype or (engine_dtype == "auto" and train_dtype == "auto"), "engine.dtype",
          f"{why} the engine to compute in the trainer's dtype: engine.dtype ({engine_dtype}) and strategy.param_dtype "
          f"({train_dtype}) must be the same (or both auto)")


def check_exact_model(cfg, hf_config) -> None:
    """ConfigError when ``numerics.exact`` is on and the model's family is not one exact mode covers
    (:attr:`tidal.families.Family.exact`), or its config asks for something exact mode does not
    reproduce on both sides (a final logit soft-cap, which the trainer's head does not apply)."""
    if not cfg.numerics.exact:
        return
    from tidal.families import find_family, text_config

    family = find_family(hf_config)
    if family is None or not family.exact:
        name = getattr(hf_config, "model_type", type(hf_config).__name__)
        raise ConfigError("numerics.exact", f"exact mode does not cover model_type {name!r} yet (covered: Qwen2, Qwen3, Llama, "
                          "Gemma 3, Qwen3.5, Qwen3-MoE, OLMoE, Qwen3.5-MoE; docs/exact.md); set numerics.exact: false")
    if getattr(text_config(hf_config), "final_logit_softcapping", None) is not None:
        raise ConfigError("numerics.exact", "the model's final_logit_softcapping is set: the trainer's LM head does not "
                          "soft-cap its logits as the engine does; set numerics.exact: false")
