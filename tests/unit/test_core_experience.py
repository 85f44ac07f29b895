"""Experience selection/concatenation and token-budget micro-batching."""

import pytest
import torch

from tidal.strategy.base import lr_lambda
from tidal.strategy.config import OptimConfig
from tidal.trainer.experience import Experience, concat_experiences, token_budget_batches


def _exp(lengths, T):
    B = len(lengths)
    attn = torch.zeros(B, T, dtype=torch.long)
    for b, n in enumerate(lengths):
        attn[b, :n] = 1
    z = torch.zeros(B, T)
    return Experience(
        sequences_BT=torch.arange(B * T).view(B, T), attention_mask_BT=attn, action_mask_BT=attn.float(),
        old_logp_BT=z, rollout_logp_BT=z, advantages_BT=z, returns_BT=z, rewards_B=torch.arange(B).float(),
        group_ids_B=torch.arange(B), loss_mask_B=torch.ones(B),
    )


def test_token_budget_batches_hand_computed():
    # sorted by length: idx 1(2), 3(3), 0(5), 2(9); budget 10 tokens of padded rows x longest
    assert token_budget_batches([5, 2, 9, 3], max_tokens=10, max_seqs=8) == [[1, 3], [0], [2]]
    # budget 12: [1,3,0] would be 3*5=15 > 12 -> [1,3] then [0] (5), [0,2] would be 18 -> [2]
    assert token_budget_batches([5, 2, 9, 3], max_tokens=12, max_seqs=8) == [[1, 3], [0], [2]]
    assert token_budget_batches([5, 2, 9, 3], max_tokens=100, max_seqs=3) == [[1, 3, 0], [2]]
    assert token_budget_batches([4, 4, 4, 4], max_tokens=8, max_seqs=8) == [[0, 1], [2, 3]]


def test_select_trims_to_longest_selected():
    exp = _exp([2, 5, 3, 1], T=6)
    sub = exp.select([0, 3])
    assert sub.sequences_BT.shape == (2, 2)
    assert sub.rewards_B.tolist() == [0.0, 3.0]


def test_concat_pads_to_longest():
    a, b = _exp([2], T=2), _exp([4, 1], T=4)
    c = concat_experiences([a, b])
    assert c.sequences_BT.shape == (3, 4)
    assert c.attention_mask_BT.sum(-1).tolist() == [2, 4, 1]
    assert c.sequences_BT[0, 2:].tolist() == [0, 0]


def test_lr_schedules():
    f = lr_lambda(OptimConfig(lr=1.0, warmup_steps=2, scheduler="linear", min_lr_ratio=0.0), total_steps=6)
    assert [round(f(s), 6) for s in range(7)] == [0.5, 1.0, 1.0, 0.75, 0.5, 0.25, 0.0]
    g = lr_lambda(OptimConfig(lr=1.0, scheduler="cosine", min_lr_ratio=0.1), total_steps=2)
    assert [round(g(s), 6) for s in range(3)] == [1.0, 0.55, 0.1]


def test_row_is_what_the_update_trains_on():
    """Experience.row: a row's real tokens only, each per-token field aligned with input_ids, the
    absent ones (no reference, no critic) left out."""
    attn = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    act = torch.tensor([[0, 0, 1, 1, 0], [0, 1, 1, 1, 1]]).float()
    rollout = torch.tensor([[0.0, 0.0, -0.5, -0.25, 0.0], [0.0, -1.0, -2.0, -3.0, -4.0]])
    exp = Experience(
        sequences_BT=torch.tensor([[5, 6, 7, 8, 0], [1, 2, 3, 4, 9]]), attention_mask_BT=attn, action_mask_BT=act,
        old_logp_BT=rollout - 0.01 * act, rollout_logp_BT=rollout, advantages_BT=0.5 * act, returns_BT=0.5 * act,
        rewards_B=torch.tensor([1.0, 0.0]), group_ids_B=torch.tensor([3, 3]), loss_mask_B=torch.tensor([1.0, 0.0]),
    )
    row = exp.row(0)
    assert row["input_ids"] == [5, 6, 7, 8] and row["action_mask"] == [0.0, 0.0, 1.0, 1.0]
    assert row["rollout_logprobs"] == [0.0, 0.0, -0.5, -0.25]
    assert row["old_logprobs"] == pytest.approx([0.0, 0.0, -0.51, -0.26]) and row["advantages"] == [0.0, 0.0, 0.5, 0.5]
    assert (row["reward"], row["loss_mask"], row["group_id"]) == (1.0, 1.0, 3)
    assert "ref_logprobs" not in row and "values" not in row and "turn_rewards" not in row  # single turn: none
    multi = Experience(**{**exp.__dict__, "turn_rewards_BT": torch.tensor([[0.0, 0.0, -0.1, 0.0, 0.0], [0.0] * 5])})
    assert multi.row(0)["turn_rewards"] == pytest.approx([0.0, 0.0, -0.1, 0.0])  # a multi-turn row's per-turn rewards
    assert exp.row(1)["input_ids"] == [1, 2, 3, 4, 9] and exp.row(1)["loss_mask"] == 0.0
