"""Node-aware topology (issue 42 item 1): nodes from torchrun's GROUP_RANK, TP groups within a node,
``strategy.shard`` resolved per node count, with hand-computed layouts."""

import pytest
import torch

from tidal.config import load_config
from tidal.config_base import ConfigError
from tidal.distributed.runtime import Runtime
from tidal.distributed.topology import Topology, describe_sharding
from tidal.memory.plan import PlanInputs
from tidal.strategy.config import StrategyConfig


def two_by_four() -> Topology:
    return Topology.from_ranks([(0, "a")] * 4 + [(1, "b")] * 4)


def test_nodes_from_group_ranks_and_hosts():
    t = two_by_four()
    assert t.nodes == ((0, 1, 2, 3), (4, 5, 6, 7)) and t.hosts == ("a", "b")
    assert (t.world_size, t.num_nodes, t.ranks_per_node) == (8, 2, 4)
    assert [t.node_of(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert t.host_of(5) == "b"
    assert t.describe() == "2 nodes x 4 ranks (node 0: a, ranks 0-3; node 1: b, ranks 4-7)"
    assert t == Topology.from_ranks([(0, "a")] * 4 + [(1, "b")] * 4)  # every rank builds the same one


def test_simulated_nodes_share_a_host_but_not_a_group_rank():
    t = Topology.from_ranks([(0, "h"), (0, "h"), (1, "h"), (1, "h")])
    assert t.nodes == ((0, 1), (2, 3)) and t.hosts == ("h", "h")
    assert Topology.from_ranks([(0, "h")] * 3).nodes == ((0, 1, 2),)


def test_without_group_rank_each_host_is_a_node():
    t = Topology.from_ranks([("b", "b"), ("b", "b"), ("a", "a"), ("a", "a")])
    assert t.nodes == ((0, 1), (2, 3)) and t.hosts == ("b", "a")  # numbered by first rank, not by name


def test_uneven_or_interleaved_nodes_are_refused():
    with pytest.raises(ValueError, match="same torchrun --nproc_per_node"):
        Topology.from_ranks([(0, "a"), (0, "a"), (0, "a"), (1, "b")])
    with pytest.raises(ValueError, match=r"ranks \[0, 2\] share a node .* not consecutive"):
        Topology.from_ranks([(0, "a"), (1, "b"), (0, "a"), (1, "b")])


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tp_groups_that_divide_a_node_stay_in_it(tp):
    two_by_four().check_tp(tp)


def test_tp_group_across_nodes_is_a_config_error():
    t = Topology.from_ranks([(0, "a")] * 6 + [(1, "b")] * 6)
    with pytest.raises(ConfigError) as e:
        t.check_tp(4)  # TP [0-3] fits node 0, [4-7] spans nodes 0 and 1
    assert e.value.key == "engine.tp_size"
    assert "rollout TP group [4, 5, 6, 7] span nodes 0 and 1 (6 ranks per node)" in str(e.value)
    assert "divides the ranks per node (6)" in str(e.value)
    Topology.single_node(12).check_tp(4)  # one node: any divisor of the world


@pytest.mark.parametrize("setting,one_node,two_nodes", [
    ("auto", 8, 4), ("world", 8, 8), ("node", 8, 4), (2, 2, 2), (8, 8, 8), (1, 1, 1),
])
def test_shard_size(setting, one_node, two_nodes):
    assert Topology.single_node(8).shard_size(setting) == one_node
    assert two_by_four().shard_size(setting) == two_nodes


def test_shard_size_that_does_not_divide_the_world_names_the_key():
    with pytest.raises(ConfigError) as e:
        two_by_four().shard_size(3)
    assert e.value.key == "strategy.shard" and "3 must divide the number of ranks (8 = 2 node(s) x 4)" in str(e.value)


def test_shard_config_values():
    assert StrategyConfig(shard=4).shard == 4
    with pytest.raises(ConfigError, match="strategy.shard"):
        load_config("quickstart", ["strategy.shard=0"])
    with pytest.raises(ConfigError, match="strategy.shard"):
        load_config("quickstart", ["strategy.shard=rack"])
    assert load_config("quickstart", ["strategy.shard=node"]).strategy.shard == "node"
    assert load_config("quickstart", ["strategy.shard=2"]).strategy.shard == 2


def test_deepspeed_shard_needs_stage_3_and_defaults_to_world():
    with pytest.raises(ConfigError) as e:
        StrategyConfig(backend="deepspeed", zero_stage=2, shard="node")
    assert e.value.key == "shard" and "zero_stage=3" in str(e.value)
    assert StrategyConfig(backend="deepspeed", zero_stage=2).shard_setting() == "world"
    assert StrategyConfig(backend="deepspeed", shard="node").shard_setting() == "node"
    assert StrategyConfig().shard_setting() == "auto"


def test_runtime_defaults_to_one_node_of_its_world():
    rt = Runtime(rank=1, world_size=2, local_rank=1, device=torch.device("cpu"), backend="gloo", tp_size=1, tp_rank=0,
                 tp_group=None, dp_rank=1, dp_size=2, dp_group=None, cpu_group=None, tp_cpu_group=None)
    assert rt.topology == Topology.single_node(2)


def test_describe_sharding():
    assert describe_sharding(8, 8) == "models sharded over all 8 ranks"
    assert describe_sharding(4, 8) == "models sharded over 4 ranks, 2 replicas (hybrid sharding)"


def test_memory_plan_divides_by_the_shard_group():
    """Per-rank model bytes under hybrid sharding are the shard group's share, not the world's."""
    from tests.unit.test_memory_plan import inputs
    from tidal.memory.plan import _sizes, format_plan, plan_memory

    world = inputs("7b", world_size=8, local_world_size=4)
    hybrid = inputs("7b", world_size=8, local_world_size=4, num_nodes=2)
    assert isinstance(hybrid, PlanInputs) and (world.shard_size, hybrid.shard_size) == (8, 4)
    a, b = _sizes(world, offload=False), _sizes(hybrid, offload=False)
    assert b.actor_weights == 2 * a.actor_weights and b.actor_optim_device == 2 * a.actor_optim_device
    small = inputs("0.5b", world_size=8, local_world_size=4, num_nodes=2)
    assert "8 rank(s) on 2 nodes, fsdp2 sharded over 4 (hybrid)" in format_plan(plan_memory(small))


def test_watchdog_report_names_the_missing_ranks_node_and_host(tmp_path):
    """A dead node's ranks write no heartbeat: the report names them, their node and its host."""
    import json

    from tidal.run.watchdog import Watchdog, format_report

    wd = Watchdog(rank=0, world_size=4, run_dir=tmp_path, timeout_s=10.0,
                  topology=Topology.from_ranks([(0, "hostA"), (0, "hostA"), (1, "hostB"), (1, "hostB")]))
    wd.session, wd._started = "s1", 0.0
    wd.dir.mkdir(parents=True)
    wd._state = {**wd._make_state("train", "in"), "session": "s1", "entered": 0.0}
    (wd.dir / "rank1.json").write_text(json.dumps({"rank": 1, "session": "s1", "pid": 1, "step": 0, "k": 1,
                                                   "stage": "train", "state": "in", "entered": 0.0}))
    report = wd.check(now=100.0)
    assert report["behind"] == [2, 3]
    text = format_report(report, "ranks diverged")
    assert "rank 1 (node 0, host hostA): step 0, in stage 'train'" in text
    assert "rank 3 (node 1, host hostB): no heartbeat  <- behind" in text
    assert "diverged (behind): ranks [2, 3] on node 1 (host hostB)" in text


def test_watchdog_names_silent_ranks_of_a_dead_node(tmp_path):
    """Ranks whose heartbeats stopped (their node died while every rank was in the same stage, where
    positions alone show nothing) are reported once silent past the deadline, with their host."""
    import json

    from tidal.run.watchdog import Watchdog, format_report

    wd = Watchdog(rank=0, world_size=4, run_dir=tmp_path, timeout_s=10.0,
                  topology=Topology.from_ranks([(0, "hostA"), (0, "hostA"), (1, "hostB"), (1, "hostB")]))
    wd.session, wd._started = "s1", 0.0
    wd.dir.mkdir(parents=True)
    wd._state = {**wd._make_state("generate", "in"), "session": "s1", "entered": 100.0}
    for r, beat in ((1, 120.0), (2, 101.0), (3, 101.0)):
        (wd.dir / f"rank{r}.json").write_text(json.dumps({"rank": r, "session": "s1", "pid": 1, "step": 0, "k": 0,
                                                          "stage": "generate", "state": "in", "entered": 100.0, "beat": beat}))
    assert wd.check(now=105.0) is None  # silent, but not yet past the deadline (8.5 s)
    report = wd.check(now=110.0)
    assert report["behind"] == [2, 3]
    text = format_report(report, "ranks diverged")
    assert "ranks [2, 3] on node 1 (host hostB) wrote no heartbeat for 9.0 s" in text
    assert "rank 3 (node 1, host hostB): step 0, in stage 'generate' for 10.0 s, no heartbeat for 9.0 s  <- behind" in text
    assert "rank 1 (node 0, host hostA): step 0, in stage 'generate' for 10.0 s\n" in text  # alive: beat 10 s ahead of now


def test_resume_on_another_world_size(tmp_path, capsys):
    """A checkpoint saved on 4 ranks (2 nodes) resumed on 1: FSDP2's reshards (the main rank says
    so); DeepSpeed's per-rank ZeRO state is a ConfigError at checkpoint.resume; the same world and a
    checkpoint without the record pass silently."""
    import json

    from tests.runtimes import lone_runtime
    from tidal.run.resume import ResumePoint, check_world_change

    point = ResumePoint(path=tmp_path / "step_000002", step=2)
    point.path.mkdir()
    (point.path / "trainer.json").write_text(json.dumps({"step": 2, "world": {"world_size": 4, "num_nodes": 2, "ranks_per_node": 2}}))
    check_world_change(point, lone_runtime(), reshards=True)
    assert capsys.readouterr().out == ("[tidal] resuming step_000002, saved on 4 ranks (2 node(s) x 2), on 1 ranks (1 node(s) x 1): "
                                       "model and optimizer state resharded, the sampler's position re-split over the ranks "
                                       "(same global batch)\n")
    with pytest.raises(ConfigError) as e:
        check_world_change(point, lone_runtime(), reshards=False)
    assert e.value.key == "checkpoint.resume" and "loads only on the number of ranks it was saved on" in str(e.value)
    (point.path / "trainer.json").write_text(json.dumps({"step": 2}))
    check_world_change(point, lone_runtime(), reshards=False)
    check_world_change(None, lone_runtime(), reshards=False)
    assert capsys.readouterr().out == ""


def _lost_node_watchdog(tmp_path, rank):
    """Rank ``rank`` of 2 nodes x 2 ranks (hostA, hostB) at t=100 s, every other rank's heartbeat
    written at 120 s except node 1's (ranks 2, 3), silent since 101 s."""
    import json

    from tidal.run.watchdog import Watchdog

    wd = Watchdog(rank=rank, world_size=4, run_dir=tmp_path, timeout_s=10.0,
                  topology=Topology.from_ranks([(0, "hostA"), (0, "hostA"), (1, "hostB"), (1, "hostB")]))
    wd.session, wd._started = "s1", 0.0
    wd.dir.mkdir(parents=True, exist_ok=True)
    wd._state = {**wd._make_state("generate", "in"), "session": "s1", "entered": 100.0}
    for r, beat in ((0, 120.0), (1, 120.0), (2, 101.0), (3, 101.0)):
        if r != rank:
            (wd.dir / f"rank{r}.json").write_text(json.dumps({"rank": r, "session": "s1", "pid": 1, "step": 0, "k": 0,
                                                              "stage": "generate", "state": "in", "entered": 100.0, "beat": beat}))
    return wd


def test_the_first_rank_of_every_node_watches_for_lost_ranks(tmp_path):
    """With several nodes the first rank of each node checks for silent ranks (a lost node 0 has
    no rank 0 left to report it), only for those: a divergence stays rank 0's report."""
    from tidal.run.watchdog import Watchdog, format_report

    checks = [_lost_node_watchdog(tmp_path / str(r), r)._checks() for r in range(4)]
    assert checks == [True, False, True, False]
    assert not Watchdog(rank=1, world_size=2, run_dir=tmp_path, timeout_s=10.0)._checks()  # one node: rank 0 alone
    wd = _lost_node_watchdog(tmp_path / "x", 1)
    report = wd.check(now=110.0, gone_only=True)
    assert report["lost"] and report["behind"] == [2, 3]
    text = format_report(report, "ranks lost")
    assert text.splitlines()[0].startswith("[tidal.watchdog] ranks lost: ranks [2, 3] on node 1 (host hostB) wrote no "
                                           "heartbeat for 9.0 s (their processes or node are gone)")
    assert text.splitlines()[-1] == "  lost: ranks [2, 3] on node 1 (host hostB)"
    # a rank behind in position while every heartbeat is fresh: rank 0's divergence, not a lost node
    import json
    for r in (2, 3):
        (wd.dir / f"rank{r}.json").write_text(json.dumps({"rank": r, "session": "s1", "pid": 1, "step": 0, "k": 0,
                                                          "stage": "setup", "state": "in", "entered": 50.0, "beat": 120.0}))
    wd._state = {**wd._state, "k": 3}
    assert wd.check(now=121.0, gone_only=True) is None and wd.check(now=121.0)["behind"] == [0, 2, 3]


@pytest.mark.parametrize("rank,prints", [(0, True), (1, False)])
def test_a_collective_error_with_a_node_gone_ends_the_rank_with_the_watchdog_code(tmp_path, monkeypatch, rank, prints):
    """Issue 48 item 2: gloo's error for a closed connection, with node 1's ranks silent, ends the
    surviving ranks with exit code 3 (not the error's 1) and the report naming the lost node: the
    lowest surviving rank at once; the others first wait the collective timeout for its agent to end
    the job (exiting early, they would show as lost themselves in its report)."""
    from tidal.run import watchdog as wdm

    wd = _lost_node_watchdog(tmp_path, rank)
    monkeypatch.setattr(wdm.time, "time", lambda: 110.0)
    clock = [0.0]  # monotonic seconds, advanced by sleep
    monkeypatch.setattr(wdm.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(wdm.time, "sleep", lambda s: clock.__setitem__(0, clock[0] + s))
    ended = []

    def fire(report, title="ranks diverged"):
        ended.append((report, title))
        raise SystemExit(wdm.EXIT_CODE)

    monkeypatch.setattr(wd, "_fire", fire)
    err = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4242")
    with pytest.raises(SystemExit):
        wd.note(err, f"rank {rank} failed in step 0, stage 'generate'")
    report, title = ended[0]
    assert title == "ranks lost" and report["behind"] == [2, 3] and report["lost"]
    assert report["why"] == (f"rank {rank} failed in step 0, stage 'generate': ranks [2, 3] on node 1 (host hostB) "
                             "wrote no heartbeat for 9.0 s (their processes or node are gone); the collective's error: "
                             "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4242")
    assert clock[0] == 0 if prints else 4 * wd.beat_s <= clock[0] < 4 * wd.beat_s + 0.2  # rank 1 waits 4 beats first


def test_a_surviving_rank_that_is_not_the_reporter_ends_quietly_once_reported(tmp_path, monkeypatch):
    """Rank 1 waits a few beats for rank 0's report: once ``divergence.json`` holds this session's
    report it ends with exit code 3 and no second report; stopped by its agent without one, it
    reports at once."""
    import json
    import os
    import signal
    import threading

    from tidal.run import watchdog as wdm

    for stop in ("report", "sigterm"):
        wd = _lost_node_watchdog(tmp_path / stop, 1)
        monkeypatch.setattr(wdm.time, "time", lambda: 110.0)
        fired = []

        def fire(report, title, fired=fired):
            fired.append(title)
            raise SystemExit(3)

        monkeypatch.setattr(wd, "_fire", fire)
        monkeypatch.setattr(wdm, "_exit", lambda: (_ for _ in ()).throw(SystemExit(wdm.EXIT_CODE)))
        sleep, waits = wdm.time.sleep, []

        def waiting(s, wd=wd, stop=stop):
            if threading.current_thread() is not threading.main_thread():
                return sleep(s)  # time.sleep is patched for the whole process: a thread an earlier test left is not the watchdog
            waits.append(s)
            if stop == "report":
                (wd.dir / "divergence.json").write_text(json.dumps({"session": "s1", "why": "rank 0's"}))
            else:
                os.kill(os.getpid(), signal.SIGTERM)
            sleep(s)

        monkeypatch.setattr(wdm.time, "sleep", waiting)
        handler = signal.getsignal(signal.SIGTERM)
        with pytest.raises(SystemExit):
            wd.note(RuntimeError("Connection closed by peer"), "rank 1 failed in step 0, stage 'generate'")
        assert signal.getsignal(signal.SIGTERM) is handler  # restored
        assert len(waits) == 1 and fired == ([] if stop == "report" else ["ranks lost"])
        monkeypatch.undo()


def test_a_collective_error_after_another_ranks_report_ends_at_once(tmp_path, monkeypatch):
    """The reporter's own exit fails its node peers' collectives: they end quietly at once."""
    import json

    from tidal.run import watchdog as wdm

    wd = _lost_node_watchdog(tmp_path, 0)
    (wd.dir / "divergence.json").write_text(json.dumps({"session": "s1"}))
    monkeypatch.setattr(wd, "_await_silence", lambda: (_ for _ in ()).throw(AssertionError("waited")))
    monkeypatch.setattr(wdm, "_exit", lambda: (_ for _ in ()).throw(SystemExit(wdm.EXIT_CODE)))
    with pytest.raises(SystemExit):
        wd.note(RuntimeError("Connection closed by peer"), "rank 0 failed in step 0")
