"""An environment of three turns whose tool answers after 30 ms, so that trajectories are still
waiting for it when a rollout ends (``rollout.partial.mode=carry``); its outcome reward depends on
the last turn's tokens (the rewards of a group differ: the policy moves). Used as
``env.name=tests.integration.inflight_env:SlowToolEnv``."""

import time

from tidal.envs import Environment, Observation, StepResult


class SlowToolEnv(Environment):
    counter_names = ("tool_calls",)

    def reset(self, row):
        return Observation(messages=row.messages)

    def step(self, turn):
        if turn.index >= 2:
            return StepResult(done=True, reward=float(sum(turn.token_ids) % 3) / 2)
        time.sleep(0.03)
        return StepResult(observation=Observation(messages=[{"role": "user", "content": "Again."}]),
                          counters={"tool_calls": 1.0})
