"""The `job` key and the `reward_model` section: keys a job does not read are rejected when set
away from their defaults (the error names the key); the reward-model settings are validated."""

import pytest

from tidal.config import config_reference_rows, load_config
from tidal.config_base import ConfigError
from tidal.jobs import REWARD_MODEL_HINTS, REWARD_MODEL_READS

RM = ["job=reward_model", "model.path=/models/rm", "data.train=[{path: pairs.jsonl}]"]


def error_key(name: str, overrides: list[str], world: int | None = None) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        cfg = load_config(name, overrides)
        if world is not None:
            cfg.check_world(world)
    return info.value


def test_shipped_configs_pick_their_job():
    assert load_config("quickstart").job == "rl"
    cfg = load_config("rm_quickstart")
    assert cfg.job == "reward_model" and cfg.reward_model.task.name == "parity"
    cfg.check_world(1)
    cfg.check_world(2)


@pytest.mark.parametrize("override,key", [
    ("rollout.n_samples=4", "rollout.n_samples"),
    ("algorithm.kl_coef=0.1", "algorithm.kl_coef"),
    ("algorithm.mismatch.mode=token_mask", "algorithm.mismatch.mode"),
    ("reward.on_error=drop", "reward.on_error"),
    ("engine.tp_size=2", "engine.tp_size"),
    ("model.lora.rank=8", "model.lora.rank"),
    ("model.critic_path=/m", "model.critic_path"),
    ("strategy.offload_reference=false", "strategy.offload_reference"),
    ("optim.critic_lr=1e-5", "optim.critic_lr"),
    ("train.epochs=2", "train.epochs"),
    ("train.old_logprobs=recompute", "train.old_logprobs"),
    ("eval.n_samples=4", "eval.n_samples"),
    ("data.max_prompt_len=64", "data.max_prompt_len"),
    ("data.label_key=tag", "data.label_key"),
    ("logging.trajectories_every=1", "logging.trajectories_every"),
    ("task.digits=3", "task.digits"),
    ("memory.device_fraction=0.5", "memory.device_fraction"),  # the memory plan is the RL run's
])
def test_reward_model_job_rejects_keys_it_does_not_read(override, key):
    e = error_key("rm_quickstart", [override])
    assert e.key == key and "not read by job=reward_model" in e.message


def test_rejections_point_to_what_to_use_instead():
    assert "reward_model.max_length" in error_key("rm_quickstart", ["data.max_prompt_len=64"]).message
    assert "reward_model.overlong" in error_key("rm_quickstart", ["data.overlong_prompt=drop"]).message
    assert "run.steps" in error_key("rm_quickstart", ["train.epochs=2"]).message
    assert "LoRA" in error_key("rm_quickstart", ["model.lora.rank=8"]).message


def test_reward_model_job_accepts_the_keys_it_reads():
    cfg = load_config("rm_quickstart", [
        "strategy.backend=deepspeed", "strategy.zero_stage=2", "train.micro_batch_tokens=256", "train.max_skipped_steps_in_a_row=5",
        "eval.every=5", "eval.max_prompts=10", "data.system_prompt=hi", "optim.scheduler=linear", "checkpoint.every=3",
        "logging.log_every=2", "model.gradient_checkpointing=true", "reward_model.center_rewards_coef=0.01",
    ])
    assert cfg.strategy.zero_stage == 2 and cfg.train.micro_batch_tokens == 256


@pytest.mark.parametrize("override,key", [
    ("reward_model.batch_pairs=8", "reward_model.batch_pairs"),
    ("reward_model.task.name=parity", "reward_model.task.name"),
    ("reward_model.separator=' '", "reward_model.separator"),
])
def test_rl_job_rejects_reward_model_settings(override, key):
    e = error_key("quickstart", [override])
    assert e.key == key and "only by job=reward_model" in e.message


@pytest.mark.parametrize("override,key", [
    ("reward_model.max_length=1", "reward_model.max_length"),
    ("reward_model.batch_pairs=0", "reward_model.batch_pairs"),
    ("reward_model.rejected_key=chosen", "reward_model.rejected_key"),
    ("reward_model.center_rewards_coef=-1", "reward_model.center_rewards_coef"),
    ("reward_model.overlong=cut", "reward_model.overlong"),
    ("reward_model.bad_pairs=ignore", "reward_model.bad_pairs"),
    ("reward_model.task.name=bogus", "reward_model.task.name"),
    ("reward_model.task.hidden_size=30", "reward_model.task.hidden_size"),
    ("reward_model.chosen_key=prompt", "reward_model.chosen_key"),
    ("train.micro_batch_max_seqs=1", "train.micro_batch_max_seqs"),
    ("job=sft", "job"),
])
def test_invalid_reward_model_settings(override, key):
    assert error_key("rm_quickstart", [override]).key == key


def test_model_and_data_come_from_the_task_or_the_config():
    assert error_key("rm_quickstart", ["model.path=/m"]).key == "model.path"
    assert error_key("rm_quickstart", ["data.train=[{path: x.jsonl}]"]).key == "data.train"
    assert error_key("rm_quickstart", ["reward_model.task.name=''"]).key == "model.path"
    assert error_key("rm_quickstart", ["reward_model.task.name=''", "model.path=/m"]).key == "data.train"
    cfg = load_config("rm_quickstart", ["reward_model.task.name=''", *RM[1:]])
    assert cfg.model.path == "/models/rm"


def test_batch_pairs_must_split_over_the_ranks():
    e = error_key("rm_quickstart", ["reward_model.batch_pairs=6"], world=4)
    assert e.key == "reward_model.batch_pairs" and "WORLD_SIZE (4)" in e.message


def test_the_read_list_names_real_keys():
    keys = [k for k, _, _ in config_reference_rows()]
    for entry in list(REWARD_MODEL_READS) + list(REWARD_MODEL_HINTS):
        assert any(k == entry or k.startswith(entry + ".") for k in keys), entry


def test_settings_this_run_never_reads_are_errors():
    no_task = ["reward_model.task.name=''", *RM[1:]]
    e = error_key("rm_quickstart", no_task + ["reward_model.task.num_train=10"])
    assert e.key == "reward_model.task.num_train" and "reward_model.task.name" in e.message
    assert error_key("rm_quickstart", ["logging.wandb_project=x"]).key == "logging.wandb_project"
    load_config("rm_quickstart", no_task + ["reward_model.task.workdir=/tmp/x"])  # a workdir is harmless
