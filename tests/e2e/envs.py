"""Environments for pipeline tests (named by import path in ``env.name``)."""

from tidal.envs import Environment, Observation, StepResult


class CountingEnv(Environment):
    """Row r of a data file needs ``1 + r % 3`` turns; a user message "Again." follows every turn
    but the last, with a per-turn reward of 0.25; the last step is done with outcome reward 1."""

    counter_names = ("again",)

    def reset(self, row):
        self.turns = 1 + int(row.where.rsplit(":", 1)[1]) % 3
        return Observation(messages=row.messages)

    def step(self, turn):
        if turn.index + 1 >= self.turns:
            return StepResult(done=True, reward=1.0)
        return StepResult(observation=Observation(messages=[{"role": "user", "content": "Again."}]), reward=0.25,
                          counters={"again": 1.0})
