"""RewardEngine: computes every configured reward component for a batch and the weighted total.

Contract:
- ``score(samples)`` returns a :class:`~tidal.rewards.types.RewardOutput` for exactly those samples.
  Each sample's recipe is ``reward.recipes[sample.label]`` (``RewardConfig.unlabelled_recipe`` when
  the label is empty); ``total_B[b] = sum_c w_c * score_c[b]`` over that recipe.
- Rules and local reward models run on the calling thread; functions and remote services run
  concurrently on the engine's own event loop (a daemon thread), overlapping with them.
- ``score`` always returns: function and remote components get a deadline (``reward.timeout_s``,
  or one derived from their own limits); a component that has not answered by then has failed on
  each of its samples, and an event loop that does not answer its cancellation is given up for a
  new one. No exception of a user's function reaches the caller (``SystemExit`` included).
- A component error on a sample raises :class:`RewardError` naming the component and the sample
  (``on_error: raise``), or marks the sample invalid and counts it (``on_error: drop``). A score
  that is not finite in float32 (NaN, inf, 1e39) is such an error, whatever component gave it.
- Scoring while decoding (:class:`~tidal.rewards.stream.RewardStream`): ``prescore`` scores a
  piece of the batch early with the components that score each sample on its own (``streams``:
  per-sample functions, remote services, rules but ``math_answer``); ``score(samples, prescored=...)`` then scores only
  what is missing and returns exactly what ``score(samples)`` returns (the same rewards, errors,
  drops and counts; ``seconds`` add up the pieces). Batched functions and reward models always
  score the whole batch in ``score``.
- No collectives: every rank calls ``score`` for its own samples. Local reward models score every
  sample of every call (fixed forward count per batch size), so ranks stay in step if a strategy's
  placement shards them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import math
import threading
import time
from typing import Any, Coroutine

import torch

from tidal.rewards.base import FLOAT32_MAX, AsyncComponent, ComponentResult, RewardError, SyncComponent, score_problem
from tidal.rewards.config import ComponentSpec, RewardConfig
from tidal.rewards.placement import LocalPlacement, ModelPlacement
from tidal.rewards.types import RewardOutput, RewardSample


@dataclasses.dataclass
class Prescored:
    """Component results computed ahead of :meth:`RewardEngine.score` (see the module docstring).

    entries: component -> batch position -> (score, error message or None).
    counters / seconds: per component, summed over the calls that made the entries.
    late: a call ran past its deadline.
    """

    entries: dict[str, dict[int, tuple[float, str | None]]] = dataclasses.field(default_factory=dict)
    counters: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    late: bool = False

    def add(self, other: "Prescored", positions: list[int]) -> None:
        """Merge ``other``, whose entry i stands at batch position ``positions[i]``."""
        for name, got in other.entries.items():
            mine = self.entries.setdefault(name, {})
            mine.update({positions[i]: v for i, v in got.items()})
        for name, counters in other.counters.items():
            mine = self.counters.setdefault(name, {})
            for k, v in counters.items():
                mine[k] = mine.get(k, 0.0) + v
        for name, sec in other.seconds.items():
            self.seconds[name] = self.seconds.get(name, 0.0) + sec
        self.late = self.late or other.late


def build_component(spec: ComponentSpec, *, device: torch.device, placement: ModelPlacement, key: str):
    """The component object of one validated spec (imports functions, loads models)."""
    if spec.type == "rule":
        from tidal.rewards.rules import RULES, RuleComponent

        return RuleComponent(RULES.get(spec.rule, f"{key}.rule")(spec.settings))
    if spec.type == "function":
        from tidal.rewards.function import FunctionReward

        return FunctionReward(spec.settings, key=key)
    if spec.type == "model":
        from tidal.rewards.model import ModelReward

        return ModelReward(spec.settings, device=device, placement=placement, key=key)
    if spec.type == "remote":
        from tidal.rewards.remote import RemoteReward

        return RemoteReward(spec.settings, key=key)
    raise AssertionError(f"unhandled component type {spec.type}")  # parse_component admits no other


class _LoopThread:
    """A private asyncio loop on a daemon thread (works whether or not the caller has a loop)."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="tidal-rewards-loop", daemon=True)
        self.thread.start()

    def submit(self, coro: Coroutine[Any, Any, Any]):
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def alive(self) -> bool:
        return self.thread.is_alive() and self.loop.is_running()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)
        if not self.thread.is_alive():
            self.loop.close()


DEADLINE_GRACE_S = 60.0  # added to the derived deadline: timers fire late, workers start
_CANCEL_GRACE_S = 2.0  # how long a late component has to acknowledge its cancellation


def _invalid_scores_are_errors(name: str, res: ComponentResult) -> None:
    """Every component, whatever it checked itself: a score that float32 cannot hold (NaN, inf,
    1e39) is an error of its sample, never a score."""
    for j, v in enumerate(res.scores):
        if j not in res.errors:
            problem = score_problem(float(v))
            if problem is not None:
                res.errors[j] = f"component '{name}' gave {problem}"


def _merged(pos: list[int], todo: list[int], now: ComponentResult | None, entries: dict[int, tuple[float, str | None]],
            counters: dict[str, float]) -> ComponentResult:
    """One component's result over ``pos`` from the entries scored ahead and ``now`` (over ``todo``)."""
    if now is not None and len(now.scores) != len(todo):
        return now  # a wrong count: _assemble reports it
    fresh = {b: (now.scores[j], now.errors.get(j)) for j, b in enumerate(todo)} if now is not None else {}
    out = ComponentResult(scores=[], counters=dict(counters))
    for j, b in enumerate(pos):
        score, err = fresh[b] if b in fresh else entries[b]
        out.scores.append(score)
        if err is not None:
            out.errors[j] = err
    for k, v in (now.counters if now is not None else {}).items():
        out.counters[k] = out.counters.get(k, 0.0) + v
    return out


class RewardEngine:
    """Scores batches of :class:`RewardSample` under a :class:`RewardConfig` (see module docstring)."""

    def __init__(self, cfg: RewardConfig, *, device: torch.device, placement: ModelPlacement | None = None):
        """An empty ``reward.components`` scores every sample 0 (valid): a run that learns from another
        signal only (on-policy distillation); whether a run has something to learn from is checked
        with the whole config."""
        self.cfg = cfg
        self.device = torch.device(device)
        self.placement = placement if placement is not None else LocalPlacement(self.device)
        self.components = {
            name: build_component(spec, device=self.device, placement=self.placement, key=f"reward.components.{name}")
            for name, spec in cfg.specs.items()
        }
        self._loop: _LoopThread | None = None

    # -- recipes ---------------------------------------------------------------------------------

    def _recipe_of(self, i: int, sample: RewardSample) -> list[tuple[str, float]]:
        problem = self.cfg.recipe_problem(sample.label)
        if problem is not None:
            raise RewardError(f"sample {i} {problem}")
        return self.cfg.recipe_weights[sample.label or self.cfg.unlabelled_recipe]

    def _positions(self, recipes: list[list[tuple[str, float]]]) -> dict[str, list[int]]:
        """Batch positions each component scores (all of them for scores_every_sample components)."""
        out: dict[str, list[int]] = {}
        for name, comp in self.components.items():
            every = isinstance(comp, SyncComponent) and comp.scores_every_sample
            out[name] = [b for b, r in enumerate(recipes) if every or any(c == name for c, _ in r)]
        return out

    # -- scoring ---------------------------------------------------------------------------------

    def score(self, samples: list[RewardSample], prescored: Prescored | None = None) -> RewardOutput:
        """The rewards of ``samples``; with ``prescored``, its entries stand for those components'
        results at those positions and only the rest is scored now."""
        if not self.components:
            zeros_B = torch.zeros(len(samples), dtype=torch.float32)
            return RewardOutput(total_B=zeros_B, components={}, valid_B=torch.ones(len(samples), dtype=torch.bool),
                                metrics={"reward/total/count": float(len(samples)), "reward/dropped_count": 0.0})
        recipes = [self._recipe_of(i, s) for i, s in enumerate(samples)]
        positions = self._positions(recipes)
        have = prescored.entries if prescored is not None else {}
        todo = {n: [b for b in pos if b not in have.get(n, {})] for n, pos in positions.items()}
        results, seconds, late = self._run_components(samples, todo)
        if prescored is not None:
            late = late or prescored.late
            for name, entries in have.items():
                results[name] = _merged(positions[name], todo[name], results.get(name), entries, prescored.counters.get(name, {}))
                seconds[name] = seconds.get(name, 0.0) + prescored.seconds.get(name, 0.0)
        out = self._assemble(len(samples), recipes, positions, results, seconds)
        out.metrics["reward/deadline_exceeded_max"] = float(late)
        return out

    def streams(self, name: str) -> bool:
        """Whether component ``name`` scores each sample on its own (so a batch can be scored in pieces)."""
        return getattr(self.components[name], "streams", False)

    def prescore(self, samples: list[RewardSample]) -> Prescored:
        """The results of the streaming components (:meth:`streams`) on ``samples``, entries at their
        positions in ``samples``. A sample without a recipe is skipped (``score`` reports it)."""
        names = [n for n in self.components if self.streams(n)]
        positions = {n: [] for n in self.components}
        for b, s in enumerate(samples):
            try:
                recipe = self._recipe_of(b, s)
            except RewardError:
                continue
            for n in names:
                if any(c == n for c, _ in recipe):
                    positions[n].append(b)
        results, seconds, late = self._run_components(samples, positions)
        out = Prescored(late=late)
        for name, res in results.items():
            pos = positions[name]
            if len(res.scores) != len(pos):  # score() reports it, from the whole batch
                continue
            out.entries[name] = {b: (res.scores[j], res.errors.get(j)) for j, b in enumerate(pos)}
            out.counters[name] = dict(res.counters)
            out.seconds[name] = seconds[name]
        return out

    def deadline_s(self, counts: dict[str, int]) -> float:
        """The deadline of a call whose async components score ``counts[name]`` samples each."""
        if self.cfg.timeout_s is not None:
            return self.cfg.timeout_s
        return max(self.components[n].deadline_s(k) for n, k in counts.items()) + DEADLINE_GRACE_S

    def _run_components(self, samples, positions):
        async_names = [n for n, c in self.components.items() if isinstance(c, AsyncComponent) and positions[n]]
        pending: dict[str, concurrent.futures.Future] = {}
        deadline = time.monotonic() + (self.deadline_s({n: len(positions[n]) for n in async_names}) if async_names else 0.0)
        if async_names:
            if self._loop is None or not self._loop.alive():
                self._new_loop()
            pending = {n: self._loop.submit(self._timed(n, [samples[b] for b in positions[n]])) for n in async_names}
        results: dict[str, ComponentResult] = {}
        seconds: dict[str, float] = {}
        try:
            for name, comp in self.components.items():
                if isinstance(comp, SyncComponent) and positions[name]:
                    t0 = time.perf_counter()
                    results[name] = comp.score([samples[b] for b in positions[name]])
                    seconds[name] = time.perf_counter() - t0
        finally:
            late, loop_died = self._await(pending, deadline)  # never leave async work running past this call
        for name, fut in pending.items():
            if name in late:
                msg = ("the reward event loop stopped (did the function end it, e.g. SystemExit in a task of its own?)"
                       if loop_died else f"no answer within the scoring call's deadline ({self._deadline_text()})")
                results[name], seconds[name] = ComponentResult.failed(len(positions[name]), msg), math.nan
            else:
                results[name], seconds[name] = fut.result()  # a component's own exception (e.g. HTTP 401) propagates
        return results, seconds, bool(late)

    def _deadline_text(self) -> str:
        if self.cfg.timeout_s is not None:
            return f"reward.timeout_s={self.cfg.timeout_s:g}"
        return "reward.timeout_s=null: derived from the components' own limits"

    def _await(self, pending: dict[str, concurrent.futures.Future], deadline: float) -> tuple[set[str], bool]:
        """Wait for ``pending`` until ``deadline`` (or until the loop's thread has died); cancel what
        is late. Returns (late names, whether the loop died). A loop that does not process the
        cancellations (blocked) or has died is given up."""
        if not pending:
            return set(), False
        futs = list(pending.values())
        while time.monotonic() < deadline and self._loop.alive():
            _, not_done = concurrent.futures.wait(futs, timeout=min(1.0, max(0.0, deadline - time.monotonic())))
            if not not_done:
                break
        late = {n for n, f in pending.items() if not f.done()}
        died = bool(late) and not self._loop.alive()
        for n in late:
            pending[n].cancel()
        if late:
            _, stuck = concurrent.futures.wait([pending[n] for n in late], timeout=0.0 if died else _CANCEL_GRACE_S)
            if stuck or died:
                self._abandon_loop()
        return late, died

    def _new_loop(self) -> None:
        if self._loop is not None:
            self._abandon_loop()
        self._loop = _LoopThread()

    def _abandon_loop(self) -> None:
        """Give the event loop up (its daemon thread may stay blocked); components forget what is bound to it."""
        self._loop = None
        for comp in self.components.values():
            if isinstance(comp, AsyncComponent):
                comp.detach_loop()

    async def _timed(self, name: str, batch: list[RewardSample]) -> tuple[ComponentResult, float]:
        t0 = time.perf_counter()
        res = await self.components[name].score_async(batch)
        return res, time.perf_counter() - t0

    def _weights(self, recipes: list[list[tuple[str, float]]]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(w, uses): w[c][b] is the weight of component c in sample b's recipe (0 where the recipe
        lacks c); uses[c][b] says whether the recipe has c (a weight may be 0: logged, not trained on)."""
        w = {n: torch.zeros(len(recipes), dtype=torch.float32) for n in self.components}
        uses = {n: torch.zeros(len(recipes), dtype=torch.bool) for n in self.components}
        for b, recipe in enumerate(recipes):
            for c, weight in recipe:
                w[c][b] = weight
                uses[c][b] = True
        return w, uses

    def _assemble(self, B, recipes, positions, results, seconds) -> RewardOutput:
        weights, uses = self._weights(recipes)
        components = {n: torch.zeros(B, dtype=torch.float32) for n in self.components}
        masks = {n: torch.zeros(B, dtype=torch.bool) for n in self.components}
        valid_B = torch.ones(B, dtype=torch.bool)
        metrics: dict[str, float] = {}
        for name, comp in self.components.items():
            metrics[f"reward/{name}/errors_count"] = 0.0
            metrics[f"reward/{name}/seconds"] = seconds.get(name, 0.0)
            for k in comp.counter_names:
                metrics[f"reward/{name}/{k}_count"] = 0.0
            if isinstance(comp, SyncComponent) and comp.reads_answers:  # the same keys on every rank, whether it ran here or not
                metrics[f"reward/{name}/unparsed_frac"], metrics[f"reward/{name}/unparsed_frac/count"] = math.nan, 0.0
        for name, res in results.items():
            pos = positions[name]
            if len(res.scores) != len(pos):
                raise RewardError(f"reward component '{name}' returned {len(res.scores)} scores for {len(pos)} samples")
            _invalid_scores_are_errors(name, res)
            self._apply_errors(name, pos, res, valid_B, uses[name])
            ok = [j for j in range(len(pos)) if j not in res.errors and uses[name][pos[j]]]
            if ok:
                idx = torch.tensor([pos[j] for j in ok], dtype=torch.long)
                components[name][idx] = torch.tensor([res.scores[j] for j in ok], dtype=torch.float32)
                masks[name][idx] = True
            metrics[f"reward/{name}/errors_count"] = float(len(res.errors))
            for k, v in res.counters.items():
                metrics[f"reward/{name}/{k}_count"] = float(v)
            if res.unparsed is not None and ok:  # of the responses it scored for a recipe that uses it
                metrics[f"reward/{name}/unparsed_frac"] = sum(j in res.unparsed for j in ok) / len(ok)
                metrics[f"reward/{name}/unparsed_frac/count"] = float(len(ok))
        # total_B = sum_c w_c * r_c over each sample's recipe (in float64: a sum of float32 scores may
        # overflow float32, and such a sample is invalid like a NaN one); dropped samples get 0.
        total64_B = torch.zeros(B, dtype=torch.float64)
        for name in self.components:
            total64_B += weights[name].double() * components[name].double()
        self._check_totals(total64_B, valid_B)
        total_B = torch.where(valid_B, total64_B, torch.zeros_like(total64_B)).float()
        self._summaries(metrics, components, masks, uses, valid_B, total_B)
        return RewardOutput(total_B=total_B, components=components, valid_B=valid_B, metrics=metrics, component_masks=masks)

    def _check_totals(self, total64_B: torch.Tensor, valid_B: torch.Tensor) -> None:
        """A valid sample whose weighted total is not finite in float32 fails like a component error."""
        bad = (valid_B & ~(total64_B.abs() <= FLOAT32_MAX)).nonzero().flatten().tolist()
        if bad and self.cfg.on_error == "raise":
            more = f" ({len(bad) - 1} more samples)" if len(bad) > 1 else ""
            raise RewardError(f"reward total failed on sample {bad[0]}: the weighted sum of its scores, "
                              f"{total64_B[bad[0]].item():g}, is beyond float32's range{more}")
        valid_B[bad] = False

    def _apply_errors(self, name, pos, res: ComponentResult, valid_B, uses_B) -> None:
        for j, msg in sorted(res.errors.items()):
            b = pos[j]
            if not uses_B[b]:
                continue  # scored only to keep ranks in step; this sample's recipe does not use it
            if self.cfg.on_error == "raise":
                more = f" ({len(res.errors) - 1} more samples failed)" if len(res.errors) > 1 else ""
                raise RewardError(f"reward component '{name}' failed on sample {b}: {msg}{more}")
            valid_B[b] = False

    @staticmethod
    def _summaries(metrics, components, masks, uses, valid_B, total_B) -> None:
        """Means over the valid samples whose recipe uses each component, with their counts (``K`` and
        ``K/count``: ranks combine them weighted, :mod:`tidal.logging.reduce`); NaN when the count is 0.
        ``reward/total/count`` is the number of valid samples."""
        for name, score_B in components.items():
            keep = masks[name] & valid_B
            metrics[f"reward/{name}"] = score_B[keep].double().mean().item() if keep.any() else math.nan
            metrics[f"reward/{name}/count"] = float(keep.sum())
        metrics["reward/total"] = total_B[valid_B].double().mean().item() if valid_B.any() else math.nan
        metrics["reward/total/count"] = float(valid_B.sum())
        metrics["reward/dropped_count"] = float((~valid_B).sum())

    # -- lifecycle -------------------------------------------------------------------------------

    def close(self) -> None:
        """Close HTTP sessions, worker processes and the event loop (idempotent)."""
        if self._loop is not None or any(isinstance(c, AsyncComponent) and c.needs_close() for c in self.components.values()):
            if self._loop is None or not self._loop.alive():
                self._new_loop()
            aclosers = [c.aclose() for c in self.components.values() if isinstance(c, AsyncComponent)]

            async def _all():
                await asyncio.gather(*aclosers)

            try:
                self._loop.submit(_all()).result(timeout=10)
            except concurrent.futures.TimeoutError:  # a blocked loop: give it up
                pass
            self._loop.close()
            self._loop = None
        for c in self.components.values():
            if isinstance(c, SyncComponent):
                c.close()

    def __enter__(self) -> "RewardEngine":
        return self

    def __exit__(self, *_exc) -> None:
        self.close()
