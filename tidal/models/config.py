"""Configuration of the models (``model.*``)."""

from __future__ import annotations

import dataclasses

from tidal.config_base import check


@dataclasses.dataclass(kw_only=True)
class ModelConfig:
    """Which checkpoints to train.

    path: local Hugging Face folder of the actor (weights + config + tokenizer). With a built-in
        ``task`` the task writes its model there.
    tokenizer_path: tokenizer folder if not ``path``.
    critic_path: initial critic (value model) for estimators that need one; default ``path``
        (the LM body with a fresh scalar value head).
    reference_path: frozen KL anchor; default ``path``. Created only when KL is on.
    gradient_checkpointing: recompute decoder activations in backward.
    logprob_chunk_tokens: tokens per LM-head chunk when computing logprobs (bounds fp32 logits memory).
    """

    path: str = ""
    tokenizer_path: str = ""
    critic_path: str = ""
    reference_path: str = ""
    gradient_checkpointing: bool = False
    logprob_chunk_tokens: int = 2048

    def __post_init__(self):
        check(self.logprob_chunk_tokens >= 1, "logprob_chunk_tokens", "must be >= 1")
