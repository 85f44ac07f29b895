"""Colocation: the one owner of what sits on the GPU in each phase of an iteration (spec §5, §7).

Training and rollout share the device; its memory changes hands between phases. This module makes
every placement decision, in one place (:class:`Placement`: the trained and frozen models'
phases, also the reward-model job's; :class:`Colocation`: those and the rollout engine's); the mechanisms belong to others (the Strategy moves models
and optimizer state, the engine sleeps and wakes, :mod:`tidal.sync` copies weights).

What is on the device, by phase (beyond the actor's weights, which always stay, except during
rollout with ``strategy.offload_actor_during_rollout``):

=====================  =========================================================================
at rest (between       the engine asleep at ``engine.sleep_level`` (0: awake); frozen models
phases)                (reference with ``strategy.offload_reference``, a distillation teacher
                       with ``strategy.offload_teacher``, reward models) parked; the
                       critic off with ``strategy.offload_critic``; optimizer state off with
                       ``strategy.offload_optimizer``
``rollout()``          the engine awake (KV cache, weights); used for training rollouts AND
                       evaluation
``using(model)``       that model (a no-grad forward: reference, critic, reward model, ...)
``update(state)``      the trained model, its gradients and optimizer state (measured:
                       :attr:`memory`, :mod:`tidal.logging.memory_parts`)
``sync_weights()``     actor and engine weights (the engine's KV cache stays freed)
=====================  =========================================================================

Each phase is a context manager: on exit, also when its block raises, everything it brought in
goes back to rest, so an exception in one phase never leaves the next one with the wrong models on
the device. Transitions are timed as phases of the timer (``engine_wake``, ``engine_sleep``,
``actor_offload``, ``actor_reload``, ``weight_sync``) and reported to its observers as events
(``wake_up/engine:before`` / ``:after``, ``reload_model/reference:before``, ...), which is how
tools watch memory move.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterator

import torch

from tidal.distill.remote import RemoteTeacher
from tidal.distributed.runtime import Runtime
from tidal.engine.base import RolloutEngine, supports_incremental
from tidal.logging.timer import PhaseTimer
from tidal.models.moe import MoETraining
from tidal.strategy.base import Strategy, TrainState
from tidal.sync import update_engine_weights
from tidal.trainer.config import require_resolved
from tidal.logging.memory_parts import MemoryParts
from tidal.logging.memory_peaks import DevicePeaks


@dataclasses.dataclass(kw_only=True)
class Models:
    """The models of a run. ``actor`` (and ``critic``) are trained; ``reference`` is frozen (the KL
    anchor; None without KL); the distillation teacher is a frozen local model (``teacher``) or a
    remote endpoint (``remote_teacher``), or neither. ``tokenizer`` is the actor's. ``positions``:
    the actor's context (``max_position_embeddings``; None when its config does not say), the most
    tokens a rollout may give the engine for one sequence."""

    tokenizer: Any
    actor: TrainState
    critic: TrainState | None = None
    reference: torch.nn.Module | None = None
    teacher: torch.nn.Module | None = None
    remote_teacher: RemoteTeacher | None = None
    positions: int | None = None
    moe: MoETraining | None = None  # an MoE actor's router tap, aux loss and routing replay


class Placement:
    """Owns the placement of a job's trained and frozen models, without a rollout engine: the
    phases :meth:`using` and :meth:`update` (see the module docstring). The reward-model job holds
    one directly; :class:`Colocation` adds the engine's phases. ``trained``: each trained model's
    state by the role its events name (``actor``, ``critic``, ``reward_model``)."""

    def __init__(self, *, strategy: Strategy, timer: PhaseTimer, trained: dict[str, TrainState]):
        require_resolved(strategy.cfg, "strategy", "offload_optimizer")
        self.strategy = strategy
        self.timer = timer
        self._offload_optimizer = strategy.cfg.offload_optimizer
        self._away: set[int] = set()  # ids of models kept off the device at rest
        self._roles = {id(state.model): role for role, state in trained.items()}  # what the observers' events call a model
        # the allocator's peaks per phase (the one owner of its peak counter; the timer's first observer)
        self.peaks = DevicePeaks(strategy.device)
        timer.add_observer(self.peaks)
        self.memory = MemoryParts(self.peaks, strategy.resident_bytes)  # the step's memory by component

    @property
    def runtime(self) -> Runtime:
        return self.strategy.runtime

    # ---- frozen models registered later (reward models, a teacher) ---------------------------------
    def prepare_frozen(self, model: torch.nn.Module, *, resident: bool) -> torch.nn.Module:
        """Shard a frozen model for inference and give it its rest place: on the device when
        ``resident``, else parked (it comes in only inside :meth:`using`). Implements
        :class:`tidal.rewards.placement.ModelPlacement` for the reward layer."""
        model = self.strategy.prepare_frozen(model, offload=False)
        if not resident:
            self._rest_away(model)
        return model

    # ---- phases ------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def using(self, model: torch.nn.Module) -> Iterator[torch.nn.Module]:
        """A no-grad forward of ``model``: on the device inside, back at rest after."""
        away = id(model) in self._away
        if away:
            self._move("reload_model", model, self.strategy.reload_model)
        try:
            yield model
        finally:
            if away:
                self._move("offload_model", model, self.strategy.offload_model)

    @contextlib.contextmanager
    def update(self, state: TrainState) -> Iterator[TrainState]:
        """An optimizer step of ``state`` (its forward/backward passes and the step): the model and
        its optimizer state on the device inside, back at rest after, also when the block raises."""
        model_away = id(state.model) in self._away
        try:
            if model_away:
                self._move("reload_model", state.model, self.strategy.reload_model)
            if self._offload_optimizer:
                self._move("reload_optimizer", state.model, self.strategy.reload_optimizer, state)
            with self.memory.update(self._roles[id(state.model)], state):
                yield state
        finally:
            if self._offload_optimizer:
                self._move("offload_optimizer", state.model, self.strategy.offload_optimizer, state)
            if model_away:
                self._move("offload_model", state.model, self.strategy.offload_model)

    # ---- mechanics -------------------------------------------------------------------------------
    def _rest_away(self, model: torch.nn.Module) -> None:
        self._away.add(id(model))
        self._move("offload_model", model, self.strategy.offload_model)

    def _move(self, action: str, target: torch.nn.Module | str, fn: Callable[..., Any], *args, **kwargs) -> Any:
        """Run one placement mechanism ``fn`` (with ``args``, or on the model ``target`` itself),
        marked for the timer's observers as ``<action>/<role>:before`` and ``:after`` (bytes moved
        in ``info`` when the mechanism returns them)."""
        role = target if isinstance(target, str) else self._roles.get(id(target), "frozen")
        self.timer.event(f"{action}/{role}:before")
        out = fn(*args, **kwargs) if args or isinstance(target, str) else fn(target)
        self.timer.event(f"{action}/{role}:after", {"bytes": out} if isinstance(out, int) else None)
        return out


class Colocation(Placement):
    """Owns the device's phases for one RL run (see the module docstring): :class:`Placement`'s,
    and the rollout engine's.

    Construction puts the models at rest (frozen models parked and the critic offloaded as
    configured: ``strategy.offload_*``), before the engine exists, so the two never peak together;
    :meth:`attach_engine` then gives the engine the actor's weights (first weight sync) and puts it
    to sleep. Every rank makes the same calls in the same order (weight sync and sharded forwards
    are collectives).
    """

    def __init__(self, *, strategy: Strategy, models: Models, timer: PhaseTimer):
        trained = {"actor": models.actor, **({"critic": models.critic} if models.critic is not None else {})}
        super().__init__(strategy=strategy, timer=timer, trained=trained)
        self.models = models
        placement = strategy.cfg
        self._offload_actor = placement.offload_actor_during_rollout
        if models.reference is not None:
            self._roles[id(models.reference)] = "reference"
        if models.teacher is not None:
            self._roles[id(models.teacher)] = "teacher"
        if models.reference is not None and placement.offload_reference:
            self._rest_away(models.reference)
        if models.teacher is not None and placement.offload_teacher:
            self._rest_away(models.teacher)
        if models.critic is not None and placement.offload_critic:
            self._rest_away(models.critic.model)
        self.engine: RolloutEngine | None = None
        self.engine_dtype: torch.dtype | None = None
        self.sleep_level = 0
        self.verify_sync = False
        self.engine_memory: dict[str, int] = {}  # the engine's device bytes by kind, at the end of the last rollout

    def attach_engine(self, engine: RolloutEngine, *, dtype: torch.dtype, sleep_level: int, verify: bool) -> None:
        """Take charge of the rollout engine: sync the actor's weights into it and put it to rest.
        ``dtype``: its weight dtype (``engine.dtype`` resolved); ``sleep_level``:
        ``engine.sleep_level``, what it frees at rest; ``verify``: ``sync.verify``, every weight
        sync is read back and compared."""
        self.engine, self.engine_dtype, self.sleep_level, self.verify_sync = engine, dtype, sleep_level, verify
        self.sync_weights()
        self._sleep()

    # ---- phases ------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def rollout(self) -> Iterator[RolloutEngine]:
        """Generation (training rollouts and evaluation): yields the awake engine."""
        actor = self.models.actor.model
        done: list[str] = []
        try:
            if self._offload_actor:
                with self.timer.phase("actor_offload"):
                    self._move("offload_model", actor, self.strategy.offload_model)
                done.append("actor")
            done.append("engine")
            with self.timer.phase("engine_wake"):
                self._move("wake_up", "engine", self.engine.wake_up)
            yield self.engine
        finally:
            if "engine" in done:
                self.engine_memory = self.engine.memory_report()
                with self.timer.phase("engine_sleep"):
                    self._sleep()
            if "actor" in done:
                with self.timer.phase("actor_reload"):
                    self._move("reload_model", actor, self.strategy.reload_model)

    def sync_weights(self, version: int | None = None) -> int:
        """The actor's current weights into the engine (a collective; the engine may be asleep: its
        KV cache stays freed). Returns the bytes sent. ``version``: the policy version the engine's
        tokens are stamped with from now on (the training step; incremental engines only)."""
        with self.timer.phase("weight_sync"):
            sent = self._move(
                "update_engine_weights", "engine", update_engine_weights, self.strategy, self.models.actor.model,
                self.engine, dtype=self.engine_dtype, verify=self.verify_sync,
            )
        if version is not None and supports_incremental(self.engine):
            self.engine.policy_version = version
        return sent

    # ---- mechanics -------------------------------------------------------------------------------
    def _sleep(self) -> None:
        if self.sleep_level > 0:
            self._move("sleep", "engine", self.engine.sleep, self.sleep_level)
