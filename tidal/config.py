"""The root configuration of a Tidal run: one section per component, loaded from YAML.

``load_config("quickstart")`` loads a named config shipped in ``tidal/configs``; any other string is
a YAML path. CLI overrides are ``key.sub=value`` (values parsed as YAML). Unknown keys, wrong
types and impossible values raise :class:`~tidal.config_base.ConfigError` naming the key; checks
that need the world size (``WORLD_SIZE % engine.tp_size``, batch divisibility) are in
:meth:`TidalConfig.check_world`.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Literal

import yaml

from tidal.algorithms.config import AlgorithmConfig
from tidal.config_base import ConfigError, apply_overrides, build, check, decode_utf8, load_yaml, to_dict
from tidal.data.config import DataConfig
from tidal.engine.config import EngineConfig
from tidal.envs.base import check_engine_backend
from tidal.envs.config import EnvConfig
from tidal.files import check_regular, read_bounded
from tidal.jobs import check_job, check_job_world
from tidal.logging.config import LoggingConfig
from tidal.models.config import ModelConfig, MoEConfig
from tidal.numerics import NumericsConfig, check_exact
from tidal.rewards.config import RewardConfig
from tidal.rm.config import RewardModelConfig
from tidal.strategy.config import OptimConfig, StrategyConfig
from tidal.sync.config import SyncConfig
from tidal.tasks.config import TaskConfig
from tidal.memory.config import MemoryConfig
from tidal.run.config import CheckpointConfig
from tidal.trainer.config import EvalConfig, RolloutConfig, RunConfig, TrainConfig, check_partial_rollout

CONFIG_DIR = Path(__file__).parent / "configs"


@dataclasses.dataclass(kw_only=True)
class TidalConfig:
    """job: what ``tidal train`` runs: ``rl`` (RL fine-tuning) or ``reward_model`` (Bradley-Terry
    reward-model training, settings under ``reward_model.*``); a key the job does not read must keep
    its default (see :mod:`tidal.jobs`)."""

    job: Literal["rl", "reward_model"] = "rl"
    run: RunConfig = dataclasses.field(default_factory=RunConfig)
    task: TaskConfig = dataclasses.field(default_factory=TaskConfig)
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    moe: MoEConfig = dataclasses.field(default_factory=MoEConfig)
    numerics: NumericsConfig = dataclasses.field(default_factory=NumericsConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    env: EnvConfig = dataclasses.field(default_factory=EnvConfig)
    engine: EngineConfig = dataclasses.field(default_factory=EngineConfig)
    sync: SyncConfig = dataclasses.field(default_factory=SyncConfig)
    strategy: StrategyConfig = dataclasses.field(default_factory=StrategyConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    memory: MemoryConfig = dataclasses.field(default_factory=MemoryConfig)
    algorithm: AlgorithmConfig = dataclasses.field(default_factory=AlgorithmConfig)
    reward: RewardConfig = dataclasses.field(default_factory=RewardConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
    reward_model: RewardModelConfig = dataclasses.field(default_factory=RewardModelConfig)

    def __post_init__(self):
        check_job(self)
        if self.job != "rl":
            return
        if self.task.name:
            check(not self.model.path, "model.path", f"must be empty with task.name={self.task.name!r}: the task builds the model")
            check(all(s.reasoning_gym is not None for s in self.data.train + self.data.eval), "data.train",
                  f"must be empty with task.name={self.task.name!r}: the task builds the data (reasoning-gym sources "
                  "excepted: with them the task gives the model and reasoning-gym the prompts)")
            check(not self.data.eval or bool(self.data.train), "data.eval",
                  f"with task.name={self.task.name!r} needs reasoning-gym sources in data.train too (else the task's own data is used)")
        else:
            check(bool(self.model.path), "model.path", "must be a local Hugging Face model folder (or set task.name)")
            check(bool(self.data.train), "data.train", "needs at least one prompt source (or set task.name)")
        distill = self.algorithm.distill_coef > 0
        check(not distill or self.model.teacher.enabled, "algorithm.distill_coef",
              "algorithm.distill_coef > 0 needs a teacher: model.teacher.path (local folder) or model.teacher.url")
        teacher_key = "model.teacher.path" if self.model.teacher.path else "model.teacher.url"
        check(distill or not self.model.teacher.enabled, teacher_key,
              "a teacher is set but algorithm.distill_coef is 0: set distill_coef > 0 to distil from it, or remove the teacher")
        check(distill or bool(self.reward.components), "reward.components",
              "no reward components and no distillation (algorithm.distill_coef): nothing to learn from")
        check(bool(self.reward.components) or self.algorithm.distill_task_weight == 1.0, "algorithm.distill_task_weight",
              "weights task rewards, but reward.components is empty")
        has_eval = bool(self.data.eval or (self.task.name and not self.data.train)) and (self.eval.every > 0 or self.eval.at_start or self.eval.at_end)
        check(bool(self.reward.components) or not has_eval, "eval",
              "evaluation scores responses with reward.components (correct: reward >= eval.correct_threshold); "
              "configure reward components or turn evaluation off (eval.every=0, eval.at_start=false, eval.at_end=false)")
        check(self.reward.judges_correctness or self.eval.correct_threshold == EvalConfig().correct_threshold,
              "eval.correct_threshold", "is only used when every reward component is a rule or a function (eval accuracy); "
              "with a reward model or a remote service evaluation reports the mean reward: leave it at its default")
        self._check_unused()
        if self.task.name:  # no model to read positions from yet: the micro-batches are the context check now
            self.check_micro_batches()
        check_engine_backend(self.env, self.engine.backend)
        check_partial_rollout(self)
        check_exact(self)
        check(self.moe.routing_replay == "off" or (self.engine.backend == "native" and not self.rollout.partial.enabled),
              "moe.routing_replay", "rollout replays the routing the native engine records: it needs engine.backend=native "
              "and rollout.partial off (resumed partial groups carry no routing)")
        check(
            self.rollout.prompts_per_step % self.train.mini_batches == 0,
            "train.mini_batches",
            f"rollout.prompts_per_step ({self.rollout.prompts_per_step}) must divide into {self.train.mini_batches} mini-batches",
        )

    def check_micro_batches(self) -> None:
        """The training micro-batches hold the longest sequence (a packed micro-batch never splits
        one); ``auto`` is the memory plan's to resolve to at least that (or to say what to change).
        After the context against the model's positions (:func:`tidal.build.check_context_budget`):
        a context beyond the model is the problem to name, not the micro-batch that cannot hold it."""
        longest = self.data.max_prompt_len + self.rollout.max_new_tokens
        for key in ("micro_batch_tokens", "forward_micro_batch_tokens"):
            value = getattr(self.train, key)
            check(value == "auto" or value >= longest, f"train.{key}",
                  f"({value}) must hold the longest sequence, data.max_prompt_len + rollout.max_new_tokens "
                  f"= {longest} tokens; raise it (or lower those)")

    def learning_warnings(self) -> list[str]:
        """What makes this valid config a run that cannot learn (said at start by ``tidal train``
        and ``tidal check``; not an error: the run is well-formed, only pointless)."""
        from tidal.algorithms import registry

        if self.job != "rl":
            return []
        estimator = registry.ADVANTAGE_ESTIMATORS.get(self.algorithm.advantage, "algorithm.advantage")
        if estimator.group_baseline and self.rollout.n_samples == 1:
            return [f"rollout.n_samples is 1 but algorithm.advantage={self.algorithm.advantage} takes each prompt's group of "
                    "samples as its baseline: a group of one gets advantage 0, so this run cannot learn from its rewards; "
                    "set rollout.n_samples >= 2, or an estimator without a group baseline (reinforce, reinforce_pp, gae)"]
        return self._sampling_warnings()

    def _sampling_warnings(self) -> list[str]:
        """Filters (``rollout.top_k/top_p/min_p``) whose processed distribution (what the engine
        samples from and the trainer scores with, :mod:`tidal.sampling_filter`) leaves the policy
        gradient, or the comparison with a teacher, without meaning."""
        r, out = self.rollout, []
        if r.top_k == 1:
            out.append("rollout.top_k is 1: every sampled token is the only token of its processed distribution (the one the "
                       "trainer scores, docs/engine.md), so its logprob is 0 and carries no gradient and this run cannot learn; "
                       "set rollout.top_k >= 2 (or 0)")
        if r.filter.filters and self.algorithm.distill_coef > 0:
            out.append("rollout.top_k/top_p/min_p filter the student's distribution but algorithm.distill_coef compares its "
                       "logprobs with the teacher's full softmax at temperature 1: the reverse KL is then taken against a "
                       "renormalised, cut student (each token's logprob raised by log 1/kept mass), so it is biased up by the mass the "
                       "filter removed; distil without filters")
        return out

    def _check_unused(self) -> None:
        """A setting that this run would never read, set away from its default, is an error naming
        it (no silent ignores)."""
        from tidal.algorithms import registry

        critic = registry.ADVANTAGE_ESTIMATORS.get(self.algorithm.advantage, "algorithm.advantage").needs_critic
        kl = self.algorithm.kl_coef > 0
        unused = [
            (not critic, "model.critic_path", self.model.critic_path, "", "estimators with a critic (gae)"),
            (not critic, "optim.critic_lr", self.optim.critic_lr, OptimConfig().critic_lr, "estimators with a critic (gae)"),
            (not critic, "strategy.offload_critic", self.strategy.offload_critic, False, "estimators with a critic (gae)"),
            (not kl, "model.reference_path", self.model.reference_path, "", "KL to a reference (algorithm.kl_coef > 0)"),
            (not kl, "strategy.offload_reference", self.strategy.offload_reference, True, "KL to a reference (algorithm.kl_coef > 0)"),
            (not self.model.teacher.path, "strategy.offload_teacher", self.strategy.offload_teacher, True,
             "a local distillation teacher (model.teacher.path)"),
            ("wandb" not in self.logging.backends, "logging.wandb_project", self.logging.wandb_project, "tidal", "logging.backends with wandb"),
            ("wandb" not in self.logging.backends, "logging.wandb_mode", self.logging.wandb_mode, "offline", "logging.backends with wandb"),
        ]
        if not self.task.name:
            defaults = TaskConfig()
            unused += [(True, f"task.{f.name}", getattr(self.task, f.name), getattr(defaults, f.name), "a built-in task (task.name)")
                       for f in dataclasses.fields(TaskConfig) if f.name not in ("name", "workdir")]
        if self.engine.backend == "sglang":  # its logprobs are before top-k/top-p/min-p renormalisation
            unused += [(True, "rollout.top_k", self.rollout.top_k, 0, "engine.backend other than sglang"),
                       (True, "rollout.top_p", self.rollout.top_p, 1.0, "engine.backend other than sglang"),
                       (True, "rollout.min_p", self.rollout.min_p, 0.0, "engine.backend other than sglang")]
        for applies, key, value, default, used_by in unused:
            check(not applies or value == default, key, f"is only used by {used_by}; leave it at its default ({default!r}) in this run")

    def check_world(self, world_size: int) -> None:
        """Checks that depend on the number of ranks (``engine.tp_size`` against the world is checked
        where the rollout groups are made, :func:`tidal.distributed.runtime.rollout_group_ranks`)."""
        if self.job != "rl":
            return check_job_world(self, world_size)
        check(
            self.rollout.prompts_per_step % (world_size * self.train.mini_batches) == 0,
            "rollout.prompts_per_step",
            f"({self.rollout.prompts_per_step}) must be divisible by WORLD_SIZE x train.mini_batches "
            f"({world_size} x {self.train.mini_batches}) so every rank gets whole groups in every mini-batch",
        )

    def to_dict(self) -> dict:
        return to_dict(self)


MAX_CONFIG_BYTES = 16 * 2**20  # a config is a few KB; a bigger "config" is some other file


def resolve_config_path(name_or_path: str) -> Path:
    """A shipped config name (``quickstart``) or a YAML file path (a regular file: a named pipe,
    a device or a directory is a ConfigError saying what it is)."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or os.sep in name_or_path:
        try:
            check_regular(path, "config file")
        except FileNotFoundError:
            raise ConfigError("<config>", f"config file {name_or_path!r} not found") from None
        except ValueError as e:
            raise ConfigError("<config>", str(e)) from None
        return path
    shipped = CONFIG_DIR / f"{name_or_path}.yaml"
    if not shipped.is_file():
        names = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
        raise ConfigError("<config>", f"no config file {name_or_path!r} and no shipped config of that name (shipped: {names})")
    return shipped


def load_config(name_or_path: str, overrides: list[str] | None = None) -> TidalConfig:
    path = resolve_config_path(name_or_path)
    try:
        text = decode_utf8(read_bounded(path, MAX_CONFIG_BYTES, what="config file"), str(path))
        data = load_yaml(text, str(path)) or {}
    except ConfigError as e:  # a repeated key, a recursive alias, ... named with its lines
        raise e if e.key else ConfigError("<config>", e.message) from None
    except OSError as e:
        raise ConfigError("<config>", f"cannot read {path}: {e.strerror or e}") from None
    except ValueError as e:  # not UTF-8, not a regular file, too big
        raise ConfigError("<config>", str(e)) from None
    except yaml.YAMLError as e:
        raise ConfigError("<config>", f"{path} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError("<config>", f"{path} must hold a mapping of sections")
    return build(TidalConfig, apply_overrides(data, overrides or []))


def _type_label(tp) -> str:
    import typing

    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return " \\| ".join(repr(a) for a in typing.get_args(tp))
    if origin is typing.Union:  # e.g. Literal["auto"] | int
        return " \\| ".join("None" if a is type(None) else _type_label(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp)).replace("typing.", "").replace("|", "\\|")


def config_reference_rows(cls=TidalConfig, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, type, default) of every user-settable config field, depth first."""
    import typing

    rows = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        key = f"{prefix}{f.name}"
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            rows.extend(config_reference_rows(tp, key + "."))
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            default = f.default_factory()  # type: ignore[misc]
        else:
            default = "(required)"
        default = to_dict(default)
        rows.append((key, _type_label(tp), "`" + json_default(default) + "`"))
    return rows


def json_default(value) -> str:
    import json

    return json.dumps(value) if not isinstance(value, str) else repr(value)


def config_reference_markdown() -> str:
    lines = ["| key | type | default |", "| --- | --- | --- |"]
    lines += [f"| `{k}` | {t} | {d} |" for k, t, d in config_reference_rows()]
    return "\n".join(lines)


if __name__ == "__main__":
    print(config_reference_markdown())
