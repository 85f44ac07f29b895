"""An OpenEnv environment for the adapter's test: guess a number, told higher / lower."""

from typing import Optional

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State


class Guess(Action):
    guess: str


class Feedback(Observation):
    feedback: str = ""


class GuessEnv(Environment[Guess, Feedback, State]):
    def __init__(self, secret: int = 7):
        super().__init__()
        self.secret, self.state_ = secret, State()

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, **kwargs) -> Feedback:
        if seed is not None:
            self.secret = seed
        return Feedback(feedback="Guess my number (1-100).")

    def step(self, action: Guess, timeout_s: Optional[float] = None, **kwargs) -> Feedback:
        guess = int("".join(c for c in action.guess if c.isdigit()) or 0)
        if guess == self.secret:
            return Feedback(done=True, reward=1.0)
        return Feedback(feedback="higher" if guess < self.secret else "lower", reward=-0.1)

    @property
    def state(self) -> State:
        return self.state_
