"""ExperienceMaker: prompts -> Experience (spec §7 steps 1-8).

generate (engine wake -> gather_and_generate -> sleep) -> actor old logprobs (unless the update's
forward supplies them: ``TidalConfig.reuses_policy_logprobs``) -> reference logprobs (KL on; reloaded
then offloaded) -> critic values (estimators with a critic) -> rewards on the
responses -> reward processing -> advantages. Every rank runs every stage for its own prompts, and
every model forward runs the same number of micro-batches on every rank (FSDP2 forwards are
collectives), so no rank skips a collective.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from tidal.algorithms import Algorithm
from tidal.algorithms.base import AdvantageInput
from tidal.data import PromptItem
from tidal.logging import PhaseTimer
from tidal.engine.base import Completion, RolloutEngine, SamplingParams
from tidal.models.loading import critic_values
from tidal.models.logprobs import token_logprobs
from tidal.models.vision import collate_mm_inputs
from tidal.rewards import RewardEngine
from tidal.rewards.types import RewardSample
from tidal.strategy.base import Strategy
from tidal.trainer.experience import Experience, token_budget_batches


@dataclasses.dataclass(kw_only=True)
class Rollout:
    """Raw generation results of one rank, before any model forward."""

    items: list[PromptItem]
    completions: list[Completion]  # prompt-major, n per item
    group_ids: list[int]


def equalized_count(strategy: Strategy, n_local: int) -> int:
    """The largest micro-batch count over ranks (all ranks must run that many forwards)."""
    return int(strategy.all_reduce_max([float(n_local)])[0])


def run_forward_passes(strategy: Strategy, batches: list[list[int]], fn: Callable[[list[int]], None]) -> None:
    """Call ``fn(idx)`` for each micro-batch, then ``fn(None)`` until this rank has run as many
    passes as the busiest rank. ``fn(None)`` must run a forward (e.g. on the first micro-batch) and
    discard its output: it exists only so every rank enters the same collectives."""
    total = equalized_count(strategy, len(batches))
    for i in range(total):
        fn(batches[i] if i < len(batches) else None)


class ExperienceMaker:
    def __init__(
        self,
        *,
        strategy: Strategy,
        actor: torch.nn.Module,
        critic: torch.nn.Module | None,
        reference: torch.nn.Module | None,
        engine: RolloutEngine,
        reward_engine: RewardEngine,
        algorithm: Algorithm,
        tokenizer,
        temperature: float,
        micro_batch_tokens: int,
        micro_batch_max_seqs: int,
        logprob_chunk_tokens: int,
        engine_sleep_level: int,
        offload_reference: bool,
        offload_critic: bool,
        offload_actor: bool,
        old_logprobs_pass: bool,
        timer: PhaseTimer,
    ):
        self.strategy = strategy
        self.actor = actor
        self.critic = critic
        self.reference = reference
        self.engine = engine
        self.reward_engine = reward_engine
        self.algo = algorithm
        self.tokenizer = tokenizer
        self.temperature = temperature
        self.mb_tokens = micro_batch_tokens
        self.mb_seqs = micro_batch_max_seqs
        self.chunk = logprob_chunk_tokens
        self.sleep_level = engine_sleep_level
        self.offload_reference = offload_reference
        self.offload_critic = offload_critic
        self.offload_actor = offload_actor
        self.old_logprobs_pass = old_logprobs_pass
        self.timer = timer

    # ---- stage 1-3: generation ----------------------------------------------------------------
    def generate(self, items: list[PromptItem], params: SamplingParams, first_group_id: int) -> Rollout:
        """Wake the engine, generate, put it back to sleep. With ``offload_actor`` the actor's
        parameters wait on the CPU meanwhile and are back on the device when this returns."""
        if self.offload_actor:
            with self.timer.phase("actor_offload"):
                self.strategy.offload_model(self.actor)
        with self.timer.phase("engine_wake"):
            self.strategy.wake_up(self.engine)
        with self.timer.phase("generate"):
            completions = self.strategy.generate(
                self.engine, [it.prompt_ids for it in items], params, mm_inputs=[it.mm_inputs for it in items]
            )
        with self.timer.phase("engine_sleep"):
            self.strategy.sleep(self.engine, self.sleep_level)
        if self.offload_actor:
            with self.timer.phase("actor_reload"):
                self.strategy.reload_model(self.actor)
        group_ids = [first_group_id + i for i in range(len(items)) for _ in range(params.n)]
        return Rollout(items=items, completions=completions, group_ids=group_ids)

    # ---- tensors ---------------------------------------------------------------------------------
    def _pack(self, rollout: Rollout) -> dict:
        """Right-padded [B, T] tensors of prompt + response, and ``mm_inputs``: each row's prompt
        images (None for a text row), or None when no row has images."""
        comps = rollout.completions
        pad = self.tokenizer.pad_token_id or 0
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
        n = len(comps) // max(1, len(rollout.items))
        mm = [rollout.items[b // n].mm_inputs for b in range(B)]
        return {"sequences_BT": seq_BT, "attention_mask_BT": attn_BT, "action_mask_BT": act_BT, "rollout_logp_BT": rlogp_BT,
                "mm_inputs": mm if any(m is not None for m in mm) else None}

    @torch.no_grad()
    def _per_token(self, forward, t: dict[str, torch.Tensor], batches: list[list[int]]) -> torch.Tensor:
        """Run ``forward(ids_BT, mask_BT, action_mask_BT, mm_inputs) -> x_BT`` over the micro-batches
        (equal pass counts on every rank) and scatter the results into one [B, T] tensor, zero off the
        actions."""
        out_BT = torch.zeros_like(t["rollout_logp_BT"])
        dev = self.strategy.device

        def fn(idx):
            real = idx is not None
            idx = idx if real else batches[0]
            T = int(t["attention_mask_BT"][idx].sum(-1).max())
            ids = t["sequences_BT"][idx, :T].to(dev)
            am = t["attention_mask_BT"][idx, :T].to(dev)
            act = t["action_mask_BT"][idx, :T].to(dev)
            mm = collate_mm_inputs([t["mm_inputs"][i] for i in idx] if t["mm_inputs"] else None, dev)
            x_BT = forward(ids, am, act, mm)
            if real:
                out_BT[idx, :T] = x_BT.float().cpu()

        run_forward_passes(self.strategy, batches, fn)
        return out_BT * t["action_mask_BT"]

    def _logprobs(self, model: torch.nn.Module, t: dict[str, torch.Tensor], batches: list[list[int]]) -> torch.Tensor:
        def forward(ids, am, act, mm):  # the LM head runs on the response tokens only
            return token_logprobs(model, ids, am, temperature=self.temperature, chunk_tokens=self.chunk, mm_inputs=mm,
                                  positions_BT=act)[0]

        return self._per_token(forward, t, batches)

    def _values(self, t: dict[str, torch.Tensor], batches: list[list[int]]) -> torch.Tensor:
        return self._per_token(lambda ids, am, act, mm: critic_values(self.critic, ids, am), t, batches)

    # ---- stage 4-8 ---------------------------------------------------------------------------------
    def score(self, rollout: Rollout):
        samples = []
        n = len(rollout.completions) // max(1, len(rollout.items))
        # one call for the whole rollout (a fast tokenizer decodes the batch natively)
        texts = self.tokenizer.batch_decode([c.token_ids for c in rollout.completions], skip_special_tokens=True)
        for i, (c, text) in enumerate(zip(rollout.completions, texts)):
            item = rollout.items[i // n]
            samples.append(
                RewardSample(
                    prompt=item.prompt_text,
                    response=text,
                    prompt_ids=list(c.prompt_ids),
                    response_ids=list(c.token_ids),
                    reference=item.reference,
                    label=item.label,
                    metadata=item.metadata,
                    finish_reason=c.finish_reason,
                    index=i,
                )
            )
        return samples, self.reward_engine.score(samples)

    def make(self, rollout: Rollout) -> tuple[Experience, dict[str, float], list[RewardSample]]:
        """Run stages 4-8 on a rollout; returns the Experience (on CPU), rollout metrics, and the
        reward samples (for trajectory logging). Without ``old_logprobs_pass`` the Experience has no
        old logprobs (the update's forward supplies them), and the metrics that compare them with
        the rollout's and the reference's (``mismatch/*``, ``kl/rollout``) are left out: the update
        reports the same comparisons as ``actor/mismatch_*`` and ``actor/kl``."""
        t = self._pack(rollout)
        lengths = t["attention_mask_BT"].sum(-1).tolist()
        batches = token_budget_batches(lengths, self.mb_tokens, self.mb_seqs)
        old_logp_BT = None
        if self.old_logprobs_pass:
            with self.timer.phase("actor_logprobs"):
                old_logp_BT = self._logprobs(self.actor, t, batches)
        ref_logp_BT = None
        if self.reference is not None:
            with self.timer.phase("reference_logprobs"):
                if self.offload_reference:
                    self.strategy.reload_model(self.reference)
                ref_logp_BT = self._logprobs(self.reference, t, batches)
                if self.offload_reference:
                    self.strategy.offload_model(self.reference)
        values_BT = None
        if self.critic is not None:
            with self.timer.phase("critic_values"):
                if self.offload_critic:
                    self.strategy.reload_model(self.critic)
                values_BT = self._values(t, batches)
                if self.offload_critic:
                    self.strategy.offload_model(self.critic)
        with self.timer.phase("reward"):
            samples, rew = self.score(rollout)
        action_BT = t["action_mask_BT"]
        truncated_B = torch.tensor([c.finish_reason == "length" for c in rollout.completions])
        group_ids_B = torch.tensor(rollout.group_ids, dtype=torch.long)
        with self.timer.phase("advantages"):
            rewards_B, reward_metrics, kl_BT, adv_BT, ret_BT = self._advantages(
                rew.total_B.float(), action_BT, group_ids_B, truncated_B, old_logp_BT, ref_logp_BT, values_BT
            )
        loss_mask_B = rew.valid_B.float() * self.algo.loss_mask_B(truncated_B).float()
        exp = Experience(
            sequences_BT=t["sequences_BT"], attention_mask_BT=t["attention_mask_BT"], action_mask_BT=action_BT,
            old_logp_BT=old_logp_BT, rollout_logp_BT=t["rollout_logp_BT"], ref_logp_BT=ref_logp_BT,
            values_BT=values_BT, advantages_BT=adv_BT * action_BT, returns_BT=ret_BT * action_BT,
            rewards_B=rewards_B, group_ids_B=group_ids_B, loss_mask_B=loss_mask_B, mm_inputs=t["mm_inputs"],
        )
        metrics = self._metrics(exp, rew, truncated_B, kl_BT)
        metrics.update(reward_metrics)
        return exp, metrics, samples

    def _advantages(self, total_B, action_BT, group_ids_B, truncated_B, old_logp_BT, ref_logp_BT, values_BT):
        """Reward processing, KL (in reward when configured) and advantages/returns."""
        rewards_B, reward_metrics = self.algo.process_rewards(total_B, group_ids_B, action_BT.sum(-1), truncated_B)
        token_rewards_BT = kl_BT = None
        if self.algo.cfg.kl_in_reward and old_logp_BT is None:
            raise ValueError("algorithm.kl_in_reward needs the actor's old logprobs before the update: run their pass")
        if ref_logp_BT is not None and old_logp_BT is not None:
            kl_BT = self.algo.token_kl(old_logp_BT, ref_logp_BT) * action_BT
            if self.algo.cfg.kl_in_reward:
                token_rewards_BT = self.algo.kl_reward_BT(old_logp_BT, ref_logp_BT, action_BT)
        adv_BT, ret_BT = self.algo.compute_advantages(
            AdvantageInput(
                rewards_B=rewards_B, action_mask_BT=action_BT, group_ids_B=group_ids_B,
                token_rewards_BT=token_rewards_BT, values_BT=values_BT,
            )
        )
        return rewards_B, reward_metrics, kl_BT, adv_BT, ret_BT

    def _metrics(self, exp: Experience, rew, truncated_B: torch.Tensor, kl_BT) -> dict[str, float]:
        act = exp.action_mask_BT
        ntok = act.sum().clamp_min(1)
        m = {
            "reward/mean": float(rew.total_B.float().mean()),
            "response/length_mean": float(exp.response_len_B.float().mean()),
            "response/length_max": float(exp.response_len_B.float().max()),
            "response/truncated_frac": float(truncated_B.float().mean()),
            "advantage/mean": float((exp.advantages_BT * act).sum() / ntok),
            "advantage/std": float(exp.advantages_BT[act.bool()].std()) if act.sum() > 1 else 0.0,
        }
        if exp.old_logp_BT is not None:
            diff_BT = (exp.old_logp_BT - exp.rollout_logp_BT) * act
            m["mismatch/abs_logp_diff_mean"] = float(diff_BT.abs().sum() / ntok)
            m["mismatch/logp_diff_max"] = float(diff_BT.abs().max())
        if kl_BT is not None:
            m["kl/rollout"] = float(kl_BT.sum() / ntok)
        if exp.values_BT is not None:
            m["critic/value_mean"] = float((exp.values_BT * act).sum() / ntok)
        for k, v in rew.metrics.items():
            m[k if "/" in k else f"reward/{k}"] = float(v)
        return m
