"""load_critic: a causal LM checkpoint becomes a value model with a zero head and no dropout, so the
values of one sequence are the same in every pass (train mode included)."""

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from tidal.models.loading import critic_values, load_critic


def test_critic_from_a_causal_lm_has_zero_head_and_no_dropout(tmp_path):
    cfg = Qwen2Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
                      num_hidden_layers=2, vocab_size=64)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    critic = load_critic(str(tmp_path))
    assert torch.count_nonzero(critic.score.weight) == 0
    torch.nn.init.normal_(critic.score.weight)  # as after some training
    critic.train()  # the critic trains in train mode: dropout would make two passes differ
    ids_BT = torch.randint(0, 64, (2, 7))
    mask_BT = torch.ones_like(ids_BT)
    torch.testing.assert_close(critic_values(critic, ids_BT, mask_BT), critic_values(critic, ids_BT, mask_BT), rtol=0, atol=0)
