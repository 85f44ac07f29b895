"""AlgorithmConfig: names from the registries, impossible or inert combinations named by key."""

import pytest

from tidal.algorithms import Algorithm, AlgorithmConfig
from tidal.config_base import ConfigError, build, to_dict


def test_defaults_build_and_round_trip():
    cfg = build(AlgorithmConfig, {})
    assert (cfg.advantage, cfg.policy_loss, cfg.loss_agg, cfg.kl_estimator) == ("grpo", "ppo_clip", "token_mean", "k3")
    assert build(AlgorithmConfig, to_dict(cfg)) == cfg


def test_nested_sections_build_from_yaml_dicts():
    cfg = build(AlgorithmConfig, {"mismatch": {"mode": "seq_mask", "cap": 3.0, "lower": 0.5},
                                  "dynamic_sampling": {"enabled": True, "max_tries": 5},
                                  "overlong": {"buffer_len": 64, "max_len": 512, "mask_truncated": True}})
    assert cfg.mismatch.lower == 0.5 and cfg.dynamic_sampling.max_tries == 5 and cfg.overlong.shaping


@pytest.mark.parametrize("name", ["gae", "grpo", "dr_grpo", "rloo", "reinforce", "reinforce_pp", "reinforce_pp_baseline", "cpgd"])
def test_every_estimator_selectable(name):
    assert Algorithm(build(AlgorithmConfig, {"advantage": name})).needs_critic == (name == "gae")


@pytest.mark.parametrize("name", ["ppo_clip", "gspo", "gmpo", "cispo", "cpgd"])
def test_every_policy_loss_selectable(name):
    Algorithm(build(AlgorithmConfig, {"policy_loss": name}))


@pytest.mark.parametrize(
    "data, key",
    [
        ({"advantage": "ppo"}, "advantage"),
        ({"policy_loss": "ppo"}, "policy_loss"),
        ({"loss_agg": "mean"}, "loss_agg"),
        ({"kl_estimator": "k4"}, "kl_estimator"),
        ({"unknown": 1}, "unknown"),
        ({"mismatch": {"cap": 0.5}}, "mismatch.cap"),
        ({"mismatch": {"mode": "token_truncate", "lower": 0.5}}, "mismatch.lower"),
        ({"loss_agg": "constant"}, "loss_agg_constant"),
        ({"loss_agg_constant": 100.0}, "loss_agg_constant"),
        ({"kl_in_reward": True}, "kl_in_reward"),
        ({"kl_controller": "adaptive", "kl_coef": 0.1}, "kl_target"),
        ({"kl_controller": "adaptive", "kl_target": 0.1}, "kl_controller"),
        ({"kl_target": 0.1, "kl_coef": 0.1}, "kl_target"),
        ({"advantage": "gae", "value_loss_coef": 0.0}, "value_loss_coef"),
        ({"advantage": "grpo", "gamma": 0.9}, "gamma"),
        ({"advantage": "reinforce_pp", "adv_norm": "batch"}, "adv_norm"),
        ({"dual_clip": 0.5}, "dual_clip"),
        ({"dual_clip": 3.0, "policy_loss": "cispo"}, "dual_clip"),
        ({"clip_low": 1.0}, "clip_low"),
        ({"policy_loss": "cispo", "clip_low": 1.5}, "clip_low"),
        ({"entropy_top_q": 0.0}, "entropy_top_q"),
        ({"policy_loss": "gspo", "entropy_top_q": 0.2}, "entropy_top_q"),
        ({"policy_loss": "gmpo", "mismatch": {"mode": "token_truncate"}}, "mismatch.mode"),
        ({"overlong": {"buffer_len": 64}}, "overlong.max_len"),
        ({"dynamic_sampling": {"max_tries": 0}}, "dynamic_sampling.max_tries"),
        ({"cpgd": {"weight": "equal"}}, "cpgd.weight"),
        ({"cpgd": {"drift_coef": 0.5}}, "cpgd.drift_coef"),
        ({"cpgd": {"weight": "nope"}, "advantage": "cpgd"}, "cpgd.weight"),
    ],
)
def test_invalid_configs_name_the_key(data, key):
    with pytest.raises(ConfigError) as info:
        build(AlgorithmConfig, data)
    assert info.value.key == key


def test_valid_variant_combinations():
    build(AlgorithmConfig, {"policy_loss": "cispo", "clip_low": 1.0, "clip_high": 4.0})
    build(AlgorithmConfig, {"policy_loss": "gmpo", "clip_low": 0.4, "clip_high": 0.4, "loss_agg": "seq_mean_token_mean"})
    build(AlgorithmConfig, {"advantage": "dr_grpo", "loss_agg": "constant", "loss_agg_constant": 1024.0})
    build(AlgorithmConfig, {"advantage": "cpgd", "policy_loss": "cpgd", "cpgd": {"weight": "clip_filter_like", "drift_coef": 0.05}})
    build(AlgorithmConfig, {"advantage": "reinforce_pp", "kl_coef": 0.01, "kl_in_reward": True, "gamma": 0.99})
    build(AlgorithmConfig, {"policy_loss": "gspo", "mismatch": {"mode": "seq_truncate"}})
