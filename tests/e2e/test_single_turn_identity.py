"""The single_turn environment is today's rollout: the trainer's rollout, now through the
environment path, gives bit for bit the Experience and metrics that the plain path gave
(tests/e2e/plain_rollout.py), for the same engine call (each sequence drawing from its group's and
sample's stream)."""

import dataclasses

import pytest
import torch

from tidal.build import build_trainer
from tidal.config import load_config
from tidal.distributed import shutdown
from tidal.distributed.generate import GenerateBatch, GroupGenerator
from tidal.engine.base import sequence_key

from tests.e2e import plain_rollout

CASES = {
    "grpo_kl_in_reward": ["algorithm.kl_coef=0.05", "algorithm.kl_in_reward=true", "train.old_logprobs=recompute"],
    "gae_critic_overlong": ["algorithm.advantage=gae", "algorithm.overlong.buffer_len=2", "algorithm.overlong.max_len=4",
                            "algorithm.overlong.mask_truncated=true"],
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_single_turn_experience_equals_the_plain_rollout(name, tmp_path, tiny_task_overrides):
    cfg = load_config("quickstart", tiny_task_overrides + CASES[name] + [f"run.output_dir={tmp_path}", "run.steps=1",
                                                                         "checkpoint.at_end=false"])
    trainer = build_trainer(cfg)
    try:
        maker = trainer.maker
        items, _ = trainer._next_items()
        params = trainer.sampling_params(1)
        rollout = maker.generate(items, params, first_group_id=7)
        exp, metrics, samples = maker.make(rollout)
        # the plain call: every prompt, the sampler's params, each sequence keyed by its group and sample
        keys = [sequence_key(7 + i, j) for i in range(len(items)) for j in range(params.n)]
        with trainer.colocation.rollout() as engine:
            batch = GenerateBatch(prompts=[it.prompt_ids for it in items], params=params, keys=keys)
            comps = GroupGenerator(engine, trainer.rt).round([batch], busy=False).completions[0]
        assert [t.rows[0].token_ids for t in rollout.trajectories] == [c.token_ids for c in comps]
        group_ids = [7 + i for i in range(len(items)) for _ in range(params.n)]
        ref_exp, ref_metrics = plain_rollout.make(maker, items, comps, group_ids)
        for f in dataclasses.fields(exp):
            got, want = getattr(exp, f.name), getattr(ref_exp, f.name)
            assert (got is None) == (want is None), f.name
            if isinstance(got, torch.Tensor):
                assert got.dtype == want.dtype and torch.equal(got, want), f.name
        timing = lambda m: {k: v for k, v in m.items() if not k.endswith("seconds")}  # noqa: E731 (wall clock)
        assert timing(metrics) == timing(ref_metrics) and metrics.keys() == ref_metrics.keys()
        ref_samples, _ = plain_rollout.score(maker, items, comps)
        for s, r in zip(samples, ref_samples):
            assert dataclasses.replace(s, messages=None) == r  # the same sample, plus the conversation
            assert s.messages[-1] == {"role": "assistant", "content": r.response}
    finally:
        shutdown()
