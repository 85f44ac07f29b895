"""A few tiny iterations per estimator family through the whole pipeline (engine, actor, reference,
critic, rewards, update, weight sync): the loss is finite, parameters change, and the engine
generates with the new weights."""

import dataclasses
import math

import pytest
import torch

from tidal.build import build_trainer
from tidal.config import load_config
from tidal.distributed import shutdown
from tidal.logging import PhaseObserver
from tidal.trainer.update import Updater

CASES = {
    "grpo": ["algorithm.advantage=grpo", "engine.sleep_level=2"],
    "dr_grpo_kl_loss": ["algorithm.advantage=dr_grpo", "algorithm.loss_agg=constant", "algorithm.loss_agg_constant=4.0", "algorithm.kl_coef=0.05", "algorithm.kl_estimator=k3"],
    "rloo_kl_reward": ["algorithm.advantage=rloo", "algorithm.kl_coef=0.05", "algorithm.kl_in_reward=true", "algorithm.kl_estimator=k1"],
    "gae_ppo_critic": ["algorithm.advantage=gae", "algorithm.gamma=1.0", "algorithm.lam=0.95", "optim.critic_lr=1e-3"],
    "reinforce_pp_gspo": ["algorithm.advantage=reinforce_pp", "algorithm.policy_loss=gspo", "algorithm.clip_low=3e-4", "algorithm.clip_high=4e-4", "algorithm.loss_agg=seq_mean_token_mean"],
    "cpgd": ["algorithm.advantage=cpgd", "algorithm.policy_loss=cpgd"],
    "dapo": ["algorithm.clip_high=0.28", "algorithm.dynamic_sampling.enabled=true", "algorithm.dynamic_sampling.max_tries=2",
             "algorithm.overlong.buffer_len=2", "algorithm.overlong.max_len=4", "algorithm.mismatch.mode=token_truncate"],
}


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_estimator_family_trains(name, tmp_path, tiny_task_overrides):
    cfg = load_config("quickstart", tiny_task_overrides + CASES[name] + [
        f"run.output_dir={tmp_path}", "run.steps=2", "optim.lr=1e-3", "checkpoint.at_end=false",
        "rollout.ignore_eos=true", "reward.components.correct.path=tests.e2e.rewards:text_hash_reward",
    ])
    trainer = build_trainer(cfg)
    try:
        before = _params(trainer.models.actor.model)
        critic_before = _params(trainer.models.critic.model) if trainer.models.critic else None
        assert (trainer.models.reference is not None) == (cfg.algorithm.kl_coef > 0)
        assert (trainer.models.critic is not None) == (name == "gae_ppo_critic")
        metrics = trainer.fit()
        assert math.isfinite(metrics["actor/loss"]), metrics
        assert metrics["response/length_mean"] == cfg.rollout.max_new_tokens  # ignore_eos forces the length
        changed = [n for n, p in trainer.models.actor.model.named_parameters() if not torch.equal(p.detach(), before[n])]
        assert changed, "no actor parameter changed"
        if critic_before is not None:
            assert math.isfinite(metrics["critic/value_loss"])
            assert any(not torch.equal(p.detach(), critic_before[n]) for n, p in trainer.models.critic.model.named_parameters())
        if cfg.algorithm.kl_coef > 0:
            assert "actor/kl" in metrics
            # the experience compares old and reference logprobs only when it computed the old ones
            assert ("kl/rollout" in metrics) == (not trainer.algo.reuses_policy_logprobs(cfg.train))
        if cfg.algorithm.dynamic_sampling.enabled:
            assert 1 <= metrics["dynamic_sampling/tries"] <= 2
    finally:
        shutdown()


@pytest.mark.slow
def test_offloaded_models_are_on_the_device_when_used(tmp_path, tiny_task_overrides):
    """With every offload on, each model is reloaded before it computes and offloaded after
    (the calls are no-ops on CPU, so their order is what is checked)."""
    cfg = load_config("quickstart", tiny_task_overrides + [
        f"run.output_dir={tmp_path}", "run.steps=1", "checkpoint.at_end=false", "algorithm.advantage=gae",
        "algorithm.kl_coef=0.05", "strategy.offload_critic=true", "strategy.offload_reference=true",
        "strategy.offload_actor_during_rollout=true", "strategy.offload_optimizer=true",
    ])
    trainer = build_trainer(cfg)
    events = []

    class Watch(PhaseObserver):
        def phase_begin(self, name):
            if name == "generate":
                events.append(("generate",))

        def event(self, name, info=None):
            if name.endswith(":before") and not name.startswith(("update_engine_weights", "sleep/", "wake_up/")):
                action, role = name[: -len(":before")].split("/")
                events.append((action, role))

    try:
        trainer.timer.add_observer(Watch())
        trainer.fit()
    finally:
        shutdown()
    gen = events.index(("generate",))
    assert events[gen - 1] == ("offload_model", "actor") and events[gen + 1] == ("reload_model", "actor")
    assert events[gen + 2 : gen + 4] == [("reload_model", "reference"), ("offload_model", "reference")]
    assert events[gen + 4 : gen + 6] == [("reload_model", "critic"), ("offload_model", "critic")]
    tail = events[gen + 6 :]
    assert tail[:2] == [("reload_optimizer", "actor"), ("offload_optimizer", "actor")]
    assert tail[2:6] == [("reload_model", "critic"), ("reload_optimizer", "critic"), ("offload_optimizer", "critic"),
                         ("offload_model", "critic")]


@pytest.mark.slow
@pytest.mark.parametrize("entropy_coef", [0.0, 0.5])
def test_entropy_bonus_is_the_only_gradient_when_advantages_are_zero(entropy_coef, tmp_path, tiny_task_overrides):
    """With a constant reward the policy term has zero gradient: the update moves the actor iff the
    entropy bonus is on (it is differentiated; an entropy used only as a metric is not)."""
    cfg = load_config("quickstart", tiny_task_overrides + [
        f"run.output_dir={tmp_path}", "run.steps=1", "optim.lr=1e-2", "checkpoint.at_end=false", "rollout.ignore_eos=true",
        "reward.components.correct.path=tests.e2e.rewards:constant_reward", f"algorithm.entropy_coef={entropy_coef}",
    ])
    trainer = build_trainer(cfg)
    try:
        metrics = trainer.fit()
        assert metrics["actor/entropy"] > 0
        assert (metrics["actor/grad_norm"] > 1e-6) == (entropy_coef > 0), metrics["actor/grad_norm"]
    finally:
        shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("forward_budget, expected", [
    (["train.forward_micro_batch_max_seqs=4"], [4, 4, 4, 4]),
])
def test_experience_forwards_use_their_own_micro_batch_budget(forward_budget, expected, tmp_path, tiny_task_overrides, monkeypatch):
    """train.forward_micro_batch_* splits the no-grad experience forwards; train.micro_batch_* the update."""
    import tidal.trainer.experience_maker as em
    import tidal.trainer.update as up

    calls = {"experience": [], "update": []}
    for mod, key in ((em, "experience"), (up, "update")):
        orig = mod.token_logprobs
        monkeypatch.setattr(mod, "token_logprobs", lambda m, ids, *a, _o=orig, _k=key, **k: (calls[_k].append(ids.shape[0]), _o(m, ids, *a, **k))[1])
    cfg = load_config("quickstart", tiny_task_overrides + [  # 4 prompts x 4 samples = 16 sequences
        f"run.output_dir={tmp_path}", "run.steps=1", "checkpoint.at_end=false", "rollout.ignore_eos=true",
        "train.micro_batch_max_seqs=16", "train.micro_batch_tokens=100000", "train.old_logprobs=recompute", *forward_budget,
    ])
    trainer = build_trainer(cfg)
    try:
        trainer.fit()
    finally:
        shutdown()
    assert calls["experience"] == expected
    assert calls["update"] == [16]


@pytest.mark.slow
def test_reusing_the_update_forward_for_old_logprobs_matches_the_separate_pass(tmp_path, tiny_task_overrides, monkeypatch):
    """One optimizer step per rollout: skipping the no-grad old-logprob pass (train.old_logprobs auto)
    gives the same update as running it, because the actor has not moved since the rollout."""
    import tidal.trainer.experience_maker as em

    def one_step(mode):
        calls = []
        orig = em.token_logprobs
        monkeypatch.setattr(em, "token_logprobs", lambda *a, **k: (calls.append(1), orig(*a, **k))[1])
        cfg = load_config("quickstart", tiny_task_overrides + [
            f"run.output_dir={tmp_path / mode}", "run.steps=1", "optim.lr=1e-3", "checkpoint.at_end=false",
            "rollout.ignore_eos=true", "reward.components.correct.path=tests.e2e.rewards:text_hash_reward",
            "algorithm.clip_low=1e-4", "algorithm.clip_high=1e-4", f"train.old_logprobs={mode}",
        ])
        trainer = build_trainer(cfg)
        try:
            before = _params(trainer.models.actor.model)
            metrics = trainer.fit()
            delta = {n: p.detach() - before[n] for n, p in trainer.models.actor.model.named_parameters()}
        finally:
            shutdown()
            monkeypatch.setattr(em, "token_logprobs", orig)
        return metrics, delta, len(calls)

    m_re, d_re, calls_re = one_step("recompute")
    m_auto, d_auto, calls_auto = one_step("auto")
    assert calls_re == 1 and calls_auto == 0  # one no-grad pass over the 16 sequences, or none
    assert "time/actor_logprobs" in m_re and "time/actor_logprobs" not in m_auto
    assert m_auto["actor/clip_frac"] == 0.0 and m_auto["actor/approx_kl"] == 0.0  # ratio exactly 1
    assert m_auto["actor/loss"] == pytest.approx(m_re["actor/loss"], rel=1e-5, abs=1e-7)
    assert m_auto["actor/grad_norm"] == pytest.approx(m_re["actor/grad_norm"], rel=1e-4)
    assert any(d.abs().max() > 1e-5 for d in d_auto.values())  # the step moved the actor
    for n in d_re:
        torch.testing.assert_close(d_auto[n], d_re[n], rtol=1e-3, atol=1e-6, msg=n)


@pytest.mark.slow
def test_an_experience_without_old_logprobs_refuses_what_needs_them(tmp_path, tiny_task_overrides):
    """Old logprobs taken from the update's forward allow one optimizer step per rollout, and cannot
    feed a KL reward: both misuses of the direct API raise, naming the setting to change."""
    cfg = load_config("quickstart", tiny_task_overrides + [
        f"run.output_dir={tmp_path}", "run.steps=1", "checkpoint.at_end=false", "algorithm.kl_coef=0.05",
    ])
    trainer = build_trainer(cfg)
    assert trainer.algo.reuses_policy_logprobs(cfg.train)
    try:
        exp, _, _ = trainer.collect(0)
        assert exp.old_logp_BT is None
        two_epochs = Updater(models=trainer.models, colocation=trainer.colocation, algorithm=trainer.algo, rollout=cfg.rollout,
                             train=dataclasses.replace(trainer.cfg.train, epochs=2), model=cfg.model,
                             split=trainer.perf.split)  # the run's resolved budgets
        with pytest.raises(ValueError, match="train.old_logprobs=recompute"):
            two_epochs.train(exp, generator=torch.Generator())
        trainer.maker.algo.cfg.kl_in_reward = True  # as if the pass had been skipped with a KL reward
        with pytest.raises(ValueError, match="kl_in_reward needs the actor's old logprobs"):
            trainer.collect(1)
    finally:
        shutdown()
