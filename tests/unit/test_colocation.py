"""The phase owner with a recording strategy and engine: what each phase brings in and sends away,
in order, and that every phase leaves the device at rest when its block raises."""

import dataclasses

import pytest
import torch

from tidal.logging import PhaseObserver, PhaseTimer
from tidal.strategy.base import TrainState
from tidal.strategy.config import StrategyConfig
from tidal.trainer.colocation import Colocation, Models


class FakeEngine:
    def __init__(self, log):
        self.log, self.awake = log, True

    def wake_up(self):
        self.log.append("engine.wake_up")
        self.awake = True
        return 7

    def sleep(self, level):
        self.log.append(f"engine.sleep({level})")
        self.awake = False
        return 7

    def load_weights(self, bucket):
        self.log.append(f"engine.load_weights({[n for n, _ in bucket]})")

    def memory_report(self):
        return {"weights": 1, "kv_cache": 2}


@dataclasses.dataclass
class FakeRuntime:
    device: torch.device = torch.device("cpu")


class FakeStrategy:
    """Records the mechanisms; ``on`` tracks what is on the device."""

    def __init__(self, cfg, log, names):
        self.cfg, self.log, self.names = cfg, log, names
        self.runtime = FakeRuntime()
        self.device = self.runtime.device
        self.on = set(names.values())

    def _n(self, x):
        return self.names[id(x.model if isinstance(x, TrainState) else x)]

    def offload_model(self, m):
        self.log.append(f"offload_model({self._n(m)})")
        self.on.discard(self._n(m))

    def reload_model(self, m):
        self.log.append(f"reload_model({self._n(m)})")
        self.on.add(self._n(m))

    def offload_optimizer(self, s):
        self.log.append(f"offload_optimizer({self._n(s)})")

    def reload_optimizer(self, s):
        self.log.append(f"reload_optimizer({self._n(s)})")

    def resident_bytes(self, s):  # 10 bytes of weights when on the device, 20 of optimizer state
        self.measured = (self._n(s), len(self.log))  # when it was measured: after how many moves
        return {"weights": 10 * (self._n(s) in self.on), "optimizer": 20}

    def prepare_frozen(self, model, *, offload):
        self.names[id(model)] = "rm"
        self.on.add("rm")
        return model

    def full_weights(self, model, dtype):
        yield "w", torch.zeros(2, dtype=dtype)


def _state(model):
    return TrainState(model=model, optimizer=None, scheduler=None, max_grad_norm=1.0)


def build(**strategy_cfg):
    log = []
    actor, critic, ref = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    names = {id(actor): "actor", id(critic): "critic", id(ref): "reference"}
    strategy = FakeStrategy(StrategyConfig(**{"offload_optimizer": False, **strategy_cfg}), log, names)  # as the memory plan resolves it
    models = Models(tokenizer=None, actor=_state(actor), critic=_state(critic), reference=ref)
    colocation = Colocation(strategy=strategy, models=models, timer=PhaseTimer(sync=lambda: None))
    engine = FakeEngine(log)
    colocation.attach_engine(engine, dtype=torch.float32, sleep_level=1, verify=False)
    return colocation, log, strategy, engine


def test_rest_state_after_setup():
    colocation, log, strategy, engine = build(offload_reference=True, offload_critic=True)
    assert log == ["offload_model(reference)", "offload_model(critic)", "engine.load_weights(['w'])", "engine.sleep(1)"]
    assert strategy.on == {"actor"} and not engine.awake


def test_phases_bring_in_what_they_need_and_send_it_back():
    colocation, log, strategy, engine = build(offload_reference=True, offload_critic=True, offload_optimizer=True,
                                          offload_actor_during_rollout=True)
    log.clear()
    with colocation.rollout() as eng:
        assert eng is engine and engine.awake and "actor" not in strategy.on
    with colocation.using(colocation.models.reference):
        assert "reference" in strategy.on
    with colocation.using(colocation.models.actor.model):  # at rest on the device: nothing moves
        pass
    with colocation.update(colocation.models.critic):
        assert "critic" in strategy.on
    assert log == [
        "offload_model(actor)", "engine.wake_up", "engine.sleep(1)", "reload_model(actor)",
        "reload_model(reference)", "offload_model(reference)",
        "reload_model(critic)", "reload_optimizer(critic)", "offload_optimizer(critic)", "offload_model(critic)",
    ]
    assert strategy.on == {"actor"} and not engine.awake
    assert colocation.engine_memory == {"weights": 1, "kv_cache": 2}


@pytest.mark.parametrize("phase", ["rollout", "using", "update"])
def test_an_exception_inside_a_phase_leaves_the_rest_state(phase):
    colocation, log, strategy, engine = build(offload_reference=True, offload_critic=True, offload_optimizer=True,
                                          offload_actor_during_rollout=True)
    rest_on = set(strategy.on)
    log.clear()
    cm = {"rollout": colocation.rollout(), "using": colocation.using(colocation.models.reference),
          "update": colocation.update(colocation.models.critic)}[phase]
    with pytest.raises(RuntimeError, match="boom"):
        with cm:
            raise RuntimeError("boom")
    assert strategy.on == rest_on and not engine.awake
    assert log[-1] in ("reload_model(actor)", "offload_model(reference)", "offload_model(critic)")


def test_frozen_models_registered_later_are_parked_between_uses():
    colocation, log, strategy, _ = build()
    rm = colocation.prepare_frozen(torch.nn.Linear(1, 1), resident=False)
    assert "rm" not in strategy.on
    with colocation.using(rm):
        assert "rm" in strategy.on
    assert "rm" not in strategy.on


def test_observers_see_every_move_with_its_role():
    colocation, log, strategy, _ = build(offload_reference=True)
    seen = []

    class Watch(PhaseObserver):
        def event(self, name, info=None):
            seen.append((name, info))

    colocation.timer.add_observer(Watch())
    with colocation.rollout():
        pass
    with colocation.using(colocation.models.reference):
        pass
    colocation.sync_weights()
    assert [n for n, _ in seen] == [
        "wake_up/engine:before", "wake_up/engine:after", "sleep/engine:before", "sleep/engine:after",
        "reload_model/reference:before", "reload_model/reference:after",
        "offload_model/reference:before", "offload_model/reference:after",
        "update_engine_weights/engine:before", "update_engine_weights/engine:after",
    ]
    assert seen[1][1] == {"bytes": 7} and seen[-1][1] == {"bytes": 8}  # 2 fp32 zeros sent


def test_an_unresolved_optimizer_offload_is_refused():
    """``strategy.offload_optimizer: auto`` is the memory plan's to decide; the phase owner only
    takes the decided value (a Strategy resolves it when built)."""
    with pytest.raises(ValueError, match="strategy.offload_optimizer is 'auto'"):
        build(offload_optimizer="auto")


def test_the_update_measures_what_the_trained_model_holds_while_it_is_on_the_device():
    colocation, log, strategy, engine = build(offload_critic=True, offload_optimizer=True)
    log.clear()
    with colocation.update(colocation.models.critic):
        pass
    assert log == ["reload_model(critic)", "reload_optimizer(critic)", "offload_optimizer(critic)", "offload_model(critic)"]
    assert strategy.measured == ("critic", 2)  # after the reloads, before the offloads
    assert colocation.memory.bytes == {"critic_weights": 10, "critic_optimizer": 20}  # no activation peak off CUDA
    assert colocation.memory.pop(colocation.engine_memory) == {} and colocation.memory.bytes == {}  # metrics on CUDA only
