"""The trainer's single-turn stages 4-8 as they were before environments (frozen reference): pack
plain completions, score them, reward processing and advantages. The single_turn environment
path must give exactly these tensors and metrics."""

import math
import types

import torch

from tidal.rewards.types import RewardSample
from tidal.trainer.experience import Experience, token_budget_batches


def pack(comps, items, pad):
    lens = [len(c.prompt_ids) + len(c.token_ids) for c in comps]
    B, T = len(comps), max(lens)
    seq_BT = torch.full((B, T), pad, dtype=torch.long)
    attn_BT = torch.zeros((B, T), dtype=torch.long)
    act_BT = torch.zeros((B, T), dtype=torch.float32)
    rlogp_BT = torch.zeros((B, T), dtype=torch.float32)
    for b, c in enumerate(comps):
        P, R = len(c.prompt_ids), len(c.token_ids)
        seq_BT[b, :P] = torch.tensor(c.prompt_ids)
        seq_BT[b, P : P + R] = torch.tensor(c.token_ids, dtype=torch.long)
        attn_BT[b, : P + R] = 1
        act_BT[b, P : P + R] = 1
        rlogp_BT[b, P : P + R] = torch.tensor(c.logprobs, dtype=torch.float32)
    n = len(comps) // max(1, len(items))
    mm = [items[b // n].mm_inputs for b in range(B)]
    return {"sequences_BT": seq_BT, "attention_mask_BT": attn_BT, "action_mask_BT": act_BT, "rollout_logp_BT": rlogp_BT,
            "mm_inputs": mm if any(m is not None for m in mm) else None}


def score(maker, items, comps):
    n = len(comps) // max(1, len(items))
    texts = maker.models.tokenizer.batch_decode([c.token_ids for c in comps], skip_special_tokens=True)
    samples = [
        RewardSample(prompt=items[i // n].prompt_text, response=text, prompt_ids=list(c.prompt_ids),
                     response_ids=list(c.token_ids), reference=items[i // n].reference, label=items[i // n].label,
                     metadata=items[i // n].metadata, finish_reason=c.finish_reason, index=i)
        for i, (c, text) in enumerate(zip(comps, texts))
    ]
    return samples, maker.rewards.score(samples)


def make(maker, items, comps, group_ids):
    """(Experience, metrics) of plain completions, as ExperienceMaker.make computed them."""
    t = pack(comps, items, maker.models.tokenizer.pad_token_id or 0)
    rows = types.SimpleNamespace(**t)  # the packed rows' fields the maker's forwards read
    lengths = t["attention_mask_BT"].sum(-1).tolist()
    batches = token_budget_batches(lengths, maker.train_cfg.forward_micro_batch_tokens, maker.train_cfg.forward_micro_batch_max_seqs)
    m = maker.models
    old = maker._logprobs(m.actor.model, rows, batches) if maker.old_logprobs_pass else None
    ref = maker._logprobs(m.reference, rows, batches) if m.reference is not None else None
    values = maker._values(m.critic.model, rows, batches) if m.critic is not None else None
    _, rew = score(maker, items, comps)
    act = t["action_mask_BT"]
    truncated_B = torch.tensor([c.finish_reason == "length" for c in comps])
    group_ids_B = torch.tensor(group_ids, dtype=torch.long)
    adv = maker.algo.advantages(total_B=rew.total_B.float(), action_mask_BT=act, group_ids_B=group_ids_B,
                                truncated_B=truncated_B, old_logp_BT=old, ref_logp_BT=ref, values_BT=values,
                                student_logp_BT=old if old is not None else t["rollout_logp_BT"])
    exp = Experience(sequences_BT=t["sequences_BT"], attention_mask_BT=t["attention_mask_BT"], action_mask_BT=act,
                     old_logp_BT=old, rollout_logp_BT=t["rollout_logp_BT"], ref_logp_BT=ref, values_BT=values,
                     advantages_BT=adv.advantages_BT, returns_BT=adv.returns_BT, rewards_B=adv.rewards_B,
                     group_ids_B=group_ids_B, loss_mask_B=rew.valid_B.float() * maker.algo.loss_mask_B(truncated_B).float(),
                     mm_inputs=t["mm_inputs"])
    ntok = act.sum().clamp_min(1)
    valid = rew.total_B[rew.valid_B].float()
    metrics = {
        "reward/mean": float(rew.total_B.float().mean()),
        # added with the reward alarms (the range of the trained rewards; -inf/inf: none valid)
        "reward/trajectory_max": float(valid.max()) if valid.numel() else -math.inf,
        "reward/trajectory_min": float(valid.min()) if valid.numel() else math.inf,
        "response/length_mean": float(exp.response_len_B.float().mean()),
        "response/length_max": float(exp.response_len_B.float().max()),
        "response/tokens_count": float(act.sum()),  # added with the metric reduction contract (a count: summed over ranks)
        "response/truncated_frac": float(truncated_B.float().mean()),
        "advantage/mean": float((exp.advantages_BT * act).sum() / ntok),
        "advantage/std": float(exp.advantages_BT[act.bool()].std()) if act.sum() > 1 else 0.0,
    }
    if old is not None:
        diff_BT = (old - exp.rollout_logp_BT) * act
        metrics["mismatch/abs_logp_diff_mean"] = float(diff_BT.abs().sum() / ntok)
        metrics["mismatch/logp_diff_max"] = float(diff_BT.abs().max())
    if adv.kl_BT is not None:
        metrics["kl/rollout"] = float(adv.kl_BT.sum() / ntok)
    if values is not None:
        metrics["critic/value_mean"] = float((values * act).sum() / ntok)
    for k, v in rew.metrics.items():
        metrics[k if "/" in k else f"reward/{k}"] = float(v)
    metrics.update(adv.metrics)
    return exp, metrics
