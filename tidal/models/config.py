"""Configuration of the models (``model.*``)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from tidal import families
from tidal.config_base import check


@dataclasses.dataclass(kw_only=True)
class LoraConfig:
    """LoRA adapters on the actor (``model.lora.*``, PEFT); on when ``rank > 0``.

    rank: adapter rank r (0: no LoRA, the whole actor trains).
    alpha: scaling numerator; the update is ``W + (alpha / rank) * B @ A``.
    dropout: dropout on the adapter input during training forwards. The actor stays in train mode
        for its old-logprob forward too, so anything but 0 makes old logprobs noisy; keep 0 for RL.
    target_modules: names (last path component) of the ``nn.Linear`` modules that get adapters.
        None (default): the model family's ``lora_targets`` (:mod:`tidal.families`; for the dense
        families the attention and MLP projections, ``q_proj`` ... ``down_proj``; a model of no
        family gets those too). Resolved by :meth:`targets`. On an MoE model the routed experts are
        stacked parameters, not linears; PEFT still matches a name here against them (``down_proj``
        adapts every expert's ``down_proj``).
    target_parameters: stacked-experts parameters that get adapters through PEFT's
        ``target_parameters`` (one rank-``rank`` adapter per expert), named by their path suffix, e.g.
        ``[mlp.experts.gate_up_proj, mlp.experts.down_proj]`` (Qwen3-MoE, OLMoE). Default none.
    """

    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: list[str] | None = None
    target_parameters: list[str] = dataclasses.field(default_factory=list)

    def __post_init__(self):
        check(self.rank >= 0, "rank", "must be >= 0 (0 disables LoRA)")
        check(self.alpha > 0, "alpha", "must be > 0")
        check(0 <= self.dropout < 1, "dropout", "must be in [0, 1)")
        check(not self.enabled or self.target_modules is None or bool(self.target_modules), "target_modules",
              "must name at least one module when rank > 0 (or leave it unset: the model family's)")

    def targets(self, hf_config) -> list[str]:
        """The modules that get adapters for a model of ``hf_config`` (object or config.json dict):
        ``target_modules`` when given, else the model family's ``lora_targets``."""
        if self.target_modules is not None:
            return list(self.target_modules)
        family = families.find_family(hf_config)
        return list(family.lora_targets if family is not None else families.DEFAULT_LORA_TARGETS)

    @property
    def enabled(self) -> bool:
        return self.rank > 0


@dataclasses.dataclass(kw_only=True)
class TeacherConfig:
    """The teacher of on-policy distillation (``model.teacher.*``; used when ``algorithm.distill_coef > 0``):
    it scores the tokens the student sampled. Exactly one of:

    path: a local Hugging Face folder; the model is frozen, sharded like the reference and parked
        between uses (``strategy.offload_teacher``). Its tokenizer must be the student's.
    url: a remote endpoint speaking Tidal's token-logprob API (``POST <url>/v1/token_logprobs``, see
        docs/distillation.md; ``tidal serve-teacher`` serves one); its tokenizer fingerprint
        (``GET <url>/v1/info``) must be the student's.
    The remaining keys configure the remote client: ``batch_size`` sequences per request,
    ``concurrency`` requests in flight, ``timeout_s`` per attempt, ``max_retries`` after a timeout,
    connection error or HTTP 408/429/5xx, ``token_env`` the environment variable holding a bearer
    token. A request that fails after its retries, or a malformed reply, follows ``reward.on_error``.
    """

    path: str = ""
    url: str = ""
    batch_size: int = 32
    concurrency: int = 4
    timeout_s: float = 60.0
    max_retries: int = 3
    token_env: str | None = None

    def __post_init__(self):
        check(not (self.path and self.url), "url", "give the teacher as path (local folder) or url (remote endpoint), not both")
        check(not self.url or self.url.startswith(("http://", "https://")), "url", "must start with http:// or https://")
        check(self.batch_size >= 1, "batch_size", "must be >= 1")
        check(self.concurrency >= 1, "concurrency", "must be >= 1")
        check(self.timeout_s > 0 and self.timeout_s != float("inf"), "timeout_s", "must be a finite number > 0")
        check(self.max_retries >= 0, "max_retries", "must be >= 0")

    @property
    def enabled(self) -> bool:
        return bool(self.path or self.url)


@dataclasses.dataclass(kw_only=True)
class MoEConfig:
    """Mixture-of-experts training (``moe.*``): read only when the actor is an MoE model (a family whose
    ``moe()`` is not None, e.g. ``qwen3_moe``, ``olmoe``); set away from its defaults on a dense model
    it is a config error.

    aux_loss_coef: weight of the router load-balancing loss (Switch Transformer; the family's own
        ``load_balancing_loss_func`` over every MoE layer of the micro-batch's real tokens) added to
        the policy loss, token-weighted like it. ``auto``: the model config's ``router_aux_loss_coef``
        (Qwen3-MoE 0.001, OLMoE 0.01). 0: not added (``moe/aux_loss`` is still logged).
    routing_replay: ``off``: the trainer routes every token itself. ``rollout``: the trainer's forward
        and backward use the experts the rollout engine routed each token to (per token and MoE
        layer; the gate weights still come from the trainer's router logits over those experts, so
        the router learns). Needs the native engine (it records the routing).
    """

    aux_loss_coef: Literal["auto"] | float = "auto"
    routing_replay: Literal["off", "rollout"] = "off"

    def __post_init__(self):
        check(self.aux_loss_coef == "auto" or self.aux_loss_coef >= 0, "aux_loss_coef", "must be >= 0 or auto")

    def check_model(self, is_moe: bool, model_type: str) -> None:
        """On a dense model every ``moe.*`` key must stay at its default (no silent ignores)."""
        if is_moe:
            return
        for key, default in (("aux_loss_coef", "auto"), ("routing_replay", "off")):
            check(getattr(self, key) == default, f"moe.{key}",
                  f"model.path is a dense model ({model_type}): leave it at its default ({default!r})")


@dataclasses.dataclass(kw_only=True)
class ModelConfig:
    """Which checkpoints to train.

    path: local Hugging Face folder of the actor (weights + config + tokenizer). With a built-in
        ``task`` the task writes its model there.
    tokenizer_path: tokenizer folder if not ``path``.
    critic_path: initial critic (value model) for estimators that need one; default ``path``
        (the LM body with a fresh scalar value head).
    reference_path: frozen KL anchor; default ``path``. Created only when KL is on.
    gradient_checkpointing: recompute decoder activations in backward (each layer keeps only its
        input), for the actor and the critic. ``auto`` (default): on when the memory plan needs it;
        off where no plan is made (a CPU run without ``memory.device_memory_gib``, the reward-model job).
    logprob_chunk_tokens: tokens per LM-head chunk when computing logprobs (bounds the logits held at once).
    lora: LoRA adapters on the actor (see :class:`LoraConfig`). With LoRA the reference model is the
        actor with its adapters disabled (no second copy), so ``reference_path`` must stay empty.
    teacher: the teacher of on-policy distillation (see :class:`TeacherConfig`).
    """

    path: str = ""
    tokenizer_path: str = ""
    critic_path: str = ""
    reference_path: str = ""
    gradient_checkpointing: Literal["auto"] | bool = "auto"
    logprob_chunk_tokens: int = 2048
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)
    teacher: TeacherConfig = dataclasses.field(default_factory=TeacherConfig)

    def __post_init__(self):
        check(self.logprob_chunk_tokens >= 1, "logprob_chunk_tokens", "must be >= 1")
        check(
            not self.lora.enabled or self.reference_path in ("", self.path),
            "reference_path",
            "must be empty with model.lora.rank > 0: the reference is the actor's base model with adapters disabled",
        )
