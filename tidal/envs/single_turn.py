"""``single_turn``: today's rollout as the one-turn special case of the environment path.

The first observation is the dataset's prompt ids, unchanged; the first step is final with reward
0 (the RewardEngine scores the response, as before). A trajectory is then prompt + the sampled
tokens, one row, a contiguous action mask: exactly the tensors of a plain single-turn rollout.
"""

from __future__ import annotations

from tidal.envs.base import EnvRow, Environment, ModelTurn, Observation, StepResult


class SingleTurnEnv(Environment):
    name = "single_turn"
    single_turn = True

    def reset(self, row: EnvRow) -> Observation:
        return Observation(token_ids=list(row.prompt_ids))

    def step(self, turn: ModelTurn) -> StepResult:
        return StepResult(done=True)
