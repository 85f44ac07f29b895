"""How a run measures (shared by every case of one run)."""

from __future__ import annotations

import dataclasses

# TRL's micro-batch, when not given: the most sequences (a divisor of the rollout) whose tokens fit
# the token budget of Tidal's default ``train.micro_batch_tokens``, so both train in similar slices.
TRL_MICRO_BATCH_TOKENS = 16384


@dataclasses.dataclass(kw_only=True)
class RunSettings:
    """``tidal_warmup`` / ``trl_warmup`` iterations run first and are not in the medians (the first
    one compiles; its time is ``first_iteration_s``); then up to ``tidal_steps`` / ``trl_steps``
    timed ones, fewer when the case's deadline comes first. ``trl_micro_batch``: completions per TRL
    forward/backward (None: see :func:`trl_micro_batch`); ``trl_dtype``: TRL's ``model_init_kwargs``
    dtype (float32: fp32 master weights with bf16 autocast, like Tidal);
    ``trl_gradient_checkpointing``: TRL's own default is True, the benchmark's False (faster, and
    Tidal's default). ``seed`` seeds both trainers and the natural length draws."""

    tidal_warmup: int = 2
    tidal_steps: int = 5
    trl_warmup: int = 1
    trl_steps: int = 3
    trl_micro_batch: int | None = None
    trl_dtype: str = "float32"
    trl_gradient_checkpointing: bool = False
    lr: float = 1e-6
    seed: int = 1

    def __post_init__(self):
        for name in ("tidal_steps", "trl_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("tidal_warmup", "trl_warmup"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.trl_micro_batch is not None and self.trl_micro_batch < 1:
            raise ValueError(f"trl_micro_batch must be >= 1, got {self.trl_micro_batch}")
        if self.trl_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"trl_dtype must be float32 or bfloat16, got {self.trl_dtype!r}")


def trl_micro_batch(settings: RunSettings, seqs: int, seq_tokens: int) -> int:
    """TRL's micro-batch for a rollout of ``seqs`` sequences of at most ``seq_tokens`` tokens: the
    given one (it must divide ``seqs``: one generation feeds exactly one optimizer step), else the
    largest divisor of ``seqs`` within :data:`TRL_MICRO_BATCH_TOKENS`."""
    if settings.trl_micro_batch is not None:
        if seqs % settings.trl_micro_batch:
            raise ValueError(f"trl_micro_batch ({settings.trl_micro_batch}) must divide the rollout's {seqs} sequences")
        return settings.trl_micro_batch
    fit = max(1, TRL_MICRO_BATCH_TOKENS // seq_tokens)
    return max(d for d in range(1, min(fit, seqs) + 1) if seqs % d == 0)
