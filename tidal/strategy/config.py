"""Configuration of the training backend (``strategy.*``) and optimisers (``optim.*``)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from tidal.config_base import check


@dataclasses.dataclass(kw_only=True)
class StrategyConfig:
    """Training backend.

    backend: ``fsdp2`` (torch.distributed.fsdp.fully_shard, default) or ``deepspeed`` (ZeRO).
    param_dtype: compute dtype of sharded models (``auto``: bf16 on CUDA, fp32 on CPU); master
        weights, gradients reduction and optimizer state stay fp32.
    reshard_after_forward: FSDP2 frees unsharded parameters after each layer's forward (ZeRO-3-like).
        DeepSpeed has no such switch (ZeRO-3 always re-partitions; ZeRO-1/2 never partition
        parameters), so with ``backend=deepspeed`` it must stay true.
    offload_optimizer: keep the optimizer state in host memory. With ``backend=fsdp2`` AdamW's
        moments live in pinned host memory and stream through the device during the step, a chunk
        at a time (:class:`~tidal.strategy.streamed_adamw.StreamedAdamW`): the device never holds
        the whole state. With ``backend=deepspeed`` on CUDA this is ZeRO-Offload: the fp32 master
        weights and moments stay on CPU and the AdamW step runs there (DeepSpeedCPUAdam, compiled
        on first use). ``auto`` (default): on when the memory plan needs it; off where no plan is
        made (a CPU run without ``memory.device_memory_gib``, the reward-model job, a Strategy
        built directly).
    offload_reference: keep the reference model on CPU between uses (reloaded for its logprobs).
    offload_teacher: keep a local distillation teacher (``model.teacher.path``) on CPU between uses.
    offload_critic: keep the critic on CPU outside its forward and update.
    offload_actor_during_rollout: move the actor's parameters to CPU while the engine generates.
    zero_stage: DeepSpeed ZeRO stage (1, 2 or 3); with fsdp2 it must stay at its default.
        Stage 1 partitions optimizer state, 2 also gradients, 3 also parameters (frozen models too).
    shard: over how many ranks a model is sharded (hybrid sharding: the others hold replicas).
        ``world``: all ranks (one 1-D mesh); ``node``: the ranks of one node, replicated across
        nodes, so parameter all-gathers and gradient reduce-scatters stay on the node's fast links
        and only one all-reduce of gradient shards per step crosses the network; an integer ``N``:
        blocks of ``N`` consecutive ranks (it must divide the world); ``auto`` (default): ``node``
        when the run has several nodes, else ``world``. With fsdp2 a shard size below the world
        is HSDP (``fully_shard`` over a 2-D mesh ``(replicate, shard)``). With deepspeed it is
        ZeRO++ hierarchical partitioning (``zero_hpz_partition_size``: a secondary copy of the
        stage-3 parameters partitioned within the group; gradients and optimizer state stay
        partitioned over the world), so it needs ``zero_stage=3``; there ``auto`` means ``world``.
    compile: ``torch.compile`` the decoder layers of the trained and frozen models (each layer on
        its own, before sharding; parameter names are unchanged) and the LM-head logprob kernels:
        far fewer kernel launches per forward/backward. ``auto``: on with fsdp2 on CUDA, off on
        CPU (compiling a tiny CPU model costs more than it saves); ``on`` also on CPU; ``off``:
        eager. The first micro-batches of a run pay the compilation (tens of seconds on a GPU).
        Only fsdp2 compiles: with ``backend=deepspeed`` it must be ``auto`` or ``off``.
    compile_cache_dir: where compiled code is kept across runs (torch's Inductor FX graph,
        AOTAutograd and Triton caches, see :mod:`tidal.strategy.compile_cache`), so a run whose
        layers were compiled before skips code generation. ``auto``: ``$TORCHINDUCTOR_CACHE_DIR`` if
        set, else ``~/.cache/tidal/torch_compile`` (``$TIDAL_CACHE_DIR`` or ``$XDG_CACHE_HOME``
        move it); ``off``: torch's default (``/tmp/torchinductor_<user>``); else a directory.
    """

    backend: Literal["fsdp2", "deepspeed"] = "fsdp2"
    param_dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    reshard_after_forward: bool = True
    offload_optimizer: Literal["auto"] | bool = "auto"
    offload_reference: bool = True
    offload_teacher: bool = True
    offload_critic: bool = False
    offload_actor_during_rollout: bool = False
    zero_stage: int = 3
    shard: Literal["auto", "world", "node"] | int = "auto"
    compile: Literal["auto", "on", "off"] = "auto"
    compile_cache_dir: str = "auto"

    def shard_setting(self) -> str | int:
        """``shard`` as the backend applies it: deepspeed's ``auto`` is ``world`` (its hierarchical
        partitioning holds an extra copy of the parameters: a trade the user makes)."""
        return "world" if self.backend == "deepspeed" and self.shard == "auto" else self.shard

    def compiles_on(self, device_type: str) -> bool:
        """Whether ``compile`` turns compilation on for a run on ``device_type`` (only fsdp2 compiles)."""
        return self.backend == "fsdp2" and (self.compile == "on" or (self.compile == "auto" and device_type == "cuda"))

    def __post_init__(self):
        check(self.zero_stage in (1, 2, 3), "zero_stage", "must be 1, 2 or 3")
        check(self.backend == "deepspeed" or self.zero_stage == 3, "zero_stage",
              "only applies to strategy.backend=deepspeed (FSDP2 always shards parameters, gradients and optimizer state)")
        check(
            self.backend != "deepspeed" or self.reshard_after_forward, "reshard_after_forward",
            "is an FSDP2 setting; with backend=deepspeed choose zero_stage instead (3 re-partitions after forward, 1-2 keep full parameters)",
        )
        check(not isinstance(self.shard, int) or self.shard >= 1, "shard", "must be auto, world, node or a number of ranks >= 1")
        check(self.backend != "deepspeed" or self.zero_stage == 3 or self.shard in ("auto", "world"), "shard",
              f"{self.shard!r} needs zero_stage=3 with backend=deepspeed (ZeRO++ hierarchical partitioning splits "
              "stage-3 parameters only); set strategy.shard=world or zero_stage=3")
        check(bool(self.compile_cache_dir.strip()), "compile_cache_dir", "must be auto, off or a directory")
        check(self.backend != "deepspeed" or self.compile != "on", "compile",
              "is on only with backend=fsdp2; with backend=deepspeed set it to auto or off")


@dataclasses.dataclass(kw_only=True)
class OptimConfig:
    """AdamW with warmup and a decay schedule, per trained model.

    lr / critic_lr: peak learning rates of actor and critic.
    scheduler: ``constant``, ``cosine`` (to min_lr_ratio * lr) or ``linear`` (to min_lr_ratio * lr),
        over the run's total optimizer steps, after warmup_steps of linear warmup.
    max_grad_norm: global gradient-norm clip (0 disables clipping; the norm is still reported).
    """

    lr: float = 1e-6
    critic_lr: float = 5e-6
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    warmup_steps: int = 0
    scheduler: Literal["constant", "cosine", "linear"] = "constant"
    min_lr_ratio: float = 0.0
    max_grad_norm: float = 1.0

    def __post_init__(self):
        check(self.lr > 0, "lr", "must be > 0")
        check(self.critic_lr > 0, "critic_lr", "must be > 0")
        check(self.weight_decay >= 0, "weight_decay", "must be >= 0")
        check(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "betas", "must be two numbers in [0, 1)")
        check(self.eps > 0, "eps", "must be > 0")
        check(self.warmup_steps >= 0, "warmup_steps", "must be >= 0")
        check(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", "must be in [0, 1]")
        check(self.max_grad_norm >= 0, "max_grad_norm", "must be >= 0 (0 disables clipping)")

