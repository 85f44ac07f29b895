"""An environment whose trajectories need a rank-dependent number of turns (rank 0: 1, rank 1: 3),
so the ranks of a torchrun run roll out different numbers of turns and (``env.history:
template``) rows. Used as ``env.name=tests.integration.uneven_env:UnevenEnv``."""

import os

from tidal.envs import Environment, Observation, StepResult


class UnevenEnv(Environment):
    counter_names = ("feedback",)

    def reset(self, row):
        self.turns = 1 + 2 * (int(os.environ.get("RANK", "0")) % 2)
        return Observation(messages=row.messages)

    def step(self, turn):
        if turn.index + 1 >= self.turns:
            return StepResult(done=True, reward=0.5)
        return StepResult(observation=Observation(messages=[{"role": "user", "content": "Again."}]), reward=0.1,
                          counters={"feedback": 1.0})
