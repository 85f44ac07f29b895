"""RewardStream: rewards scored while the rollout goes on, returned as if scored at the end.

``submit(positions, samples)`` hands a piece of the batch over as soon as it is known (a group of
trajectories when its last member finishes); a background thread scores it with the components
that score each sample on its own (:meth:`RewardEngine.streams`: per-sample functions, remote
services, rules whose time limit does not need the main thread), one piece after another, while
the caller decodes. ``results(samples)`` waits
for the pieces and returns ``RewardEngine.score(samples)``: the same rewards in the same order,
with the same errors, drops and counts. A piece with a sample that differs from the final
batch's at its position (it was submitted with another ``index``), a position never submitted,
and the components that need the whole batch (batched functions, reward models) are scored there. A
component's own exception in a piece is raised by ``results``.

The stream knows nothing about engines or environments: whatever learns that a trajectory ended
(today :meth:`tidal.envs.EnvRollout.run`'s ``on_trajectory``; an engine's per-completion
``on_finished`` callback later) feeds it. One stream per batch; not thread-safe for submitters.
"""

from __future__ import annotations

import concurrent.futures

from tidal.rewards.engine import Prescored, RewardEngine
from tidal.rewards.types import RewardOutput, RewardSample


class RewardStream:
    def __init__(self, engine: RewardEngine):
        self.engine = engine
        self.streams = any(engine.streams(n) for n in engine.components)  # else nothing is scored ahead
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tidal-reward-stream") if self.streams else None
        self._pieces: list[tuple[list[int], list[RewardSample], concurrent.futures.Future]] = []

    def submit(self, positions: list[int], samples: list[RewardSample]) -> None:
        """Score ``samples`` (``samples[i]`` stands at batch position ``positions[i]``) in the background."""
        if len(positions) != len(samples):
            raise ValueError(f"submit: {len(positions)} positions for {len(samples)} samples")
        if self._pool is None or not samples:
            return
        self._pieces.append((list(positions), list(samples), self._pool.submit(self.engine.prescore, list(samples))))

    def results(self, samples: list[RewardSample]) -> RewardOutput:
        """``RewardEngine.score(samples)``, from the pieces scored so far and what is missing. Ends the stream."""
        prescored = Prescored()
        try:
            for positions, piece, fut in self._pieces:
                part = fut.result()
                if all(b < len(samples) and samples[b] == s for b, s in zip(positions, piece)):
                    prescored.add(part, positions)  # else the whole piece is scored again (its counts too)
        finally:
            self.close()
        return self.engine.score(samples, prescored)

    def close(self) -> None:
        """Wait for the pieces in flight and stop the thread (idempotent)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._pieces = []
