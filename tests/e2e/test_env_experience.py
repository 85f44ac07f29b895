"""Multi-turn experience through the trainer's one rollout path (tests/e2e/envs.py:CountingEnv on
the tiny arithmetic task): trajectories of 1-3 turns, the whole conversation given to the reward
function, outcome and per-turn rewards, GRPO groups over the trajectories of one prompt, gapped
action masks (history append) or one row per turn (history template), and evaluation through the
same environment."""

import pytest
import torch

from tidal.build import build_trainer
from tidal.config import load_config
from tidal.distributed import shutdown
from tidal.trainer.evaluate import evaluate

ENV = ["env.name=tests.e2e.envs:CountingEnv", "env.max_turns=4", "reward.components.correct.path=tests.e2e.rewards:assistant_turns_reward",
       "train.old_logprobs=recompute"]


def _turn_tokens(traj, exp, b0, adv_BT):
    """The advantages of each turn's sampled tokens (the rows of traj start at row b0)."""
    out = []
    for turn in traj.turns:
        b = b0 + turn.row
        start = len(traj.rows[turn.row].prompt_ids) + turn.start
        assert exp.action_mask_BT[b, start : start + turn.num_sampled].eq(1).all()
        out.append(adv_BT[b, start : start + turn.num_sampled])
    return out


@pytest.mark.slow
@pytest.mark.parametrize("history", ["append", "template"])
def test_multi_turn_experience(history, tmp_path, tiny_task_overrides):
    cfg = load_config("quickstart", tiny_task_overrides + ENV + [f"env.history={history}", f"run.output_dir={tmp_path}",
                                                                 "run.steps=1", "checkpoint.at_end=false"])
    trainer = build_trainer(cfg)
    try:
        maker = trainer.maker
        items, _ = trainer._next_items()
        rollout = maker.generate(items, trainer.sampling_params(1), first_group_id=0)
        trajs = rollout.trajectories
        n = cfg.rollout.n_samples
        turns = [1 + it.row % 3 for it in items for _ in range(n)]
        assert [len(t.turns) for t in trajs] == turns and [t.group_id for t in trajs] == [i for i in range(len(items)) for _ in range(n)]
        scores = maker.score(trajs)
        # the reward function counted the assistant turns of the whole conversation; + the outcome reward
        assert scores.total_N.tolist() == [k + 1.0 for k in turns] and scores.valid_N.all()
        exp, metrics, samples = maker.make(rollout)
        rows_per = [k if history == "template" else 1 for k in turns]
        assert len(exp) == sum(rows_per) == len(samples)
        assert metrics["env/turns_mean"] == sum(turns) / len(turns) and metrics["reward/mean"] == pytest.approx(float(scores.total_N.mean()))
        assert metrics["env/again"] == pytest.approx(sum(k - 1 for k in turns) / len(turns))
        b0 = 0
        for traj, r in zip(trajs, rows_per):
            assert exp.group_ids_B[b0 : b0 + r].eq(traj.group_id).all()
            per_turn = _turn_tokens(traj, exp, b0, exp.advantages_BT)
            # GRPO: one normalised outcome advantage per trajectory plus the reward-to-go of its
            # per-turn rewards (0.25 at the end of every turn but the last)
            last = per_turn[-1]
            assert torch.allclose(last, last[0].expand_as(last))
            for j, adv in enumerate(per_turn):
                assert torch.allclose(adv, last[0] + 0.25 * (len(per_turn) - 1 - j)), (j, adv, last[0])
            # the trajectory dump's rows (Experience.row) carry those per-turn rewards at each turn's last sampled token
            dumped = [(v, m) for b in range(b0, b0 + r) for v, m in zip(exp.row(b)["turn_rewards"], exp.row(b)["action_mask"]) if v]
            assert dumped == [(0.25, 1.0)] * (len(traj.turns) - 1)
            if history == "append" and len(traj.turns) > 1:  # a gap (the observation) between the turns
                act = exp.action_mask_BT[b0]
                first = act.nonzero().flatten()
                assert (first[1:] - first[:-1]).max() > 1
            b0 += r
        out = evaluate(maker, trainer.data.eval_items[:6], cfg.eval, max_new_tokens=cfg.rollout.max_new_tokens, seed=0)
        assert out["eval/env/turns_mean"] == pytest.approx(sum(1 + it.row % 3 for it in trainer.data.eval_items[:6]) / 6)
        assert out["eval/greedy_reward"] == pytest.approx(out["eval/env/turns_mean"] + 1.0)
    finally:
        shutdown()
