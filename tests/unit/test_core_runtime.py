"""Rollout TP/DP groups (spec §2.2) and the single-process runtime."""

import pytest

from tidal.config_base import ConfigError
from tidal.distributed.runtime import rollout_group_ranks


def test_groups_world8_tp2():
    tp, dp = rollout_group_ranks(8, 2)
    assert tp == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dp == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_groups_world8_tp4_and_tp1():
    tp, dp = rollout_group_ranks(8, 4)
    assert tp == [[0, 1, 2, 3], [4, 5, 6, 7]] and dp == [[0, 4], [1, 5], [2, 6], [3, 7]]
    tp, dp = rollout_group_ranks(3, 1)
    assert tp == [[0], [1], [2]] and dp == [[0, 1, 2]]


def test_indivisible_world_is_a_clear_error():
    with pytest.raises(ConfigError, match=r"WORLD_SIZE % engine.tp_size != 0 \(6 % 4\)"):
        rollout_group_ranks(6, 4)


def test_tp_larger_than_the_world_says_how_to_launch():
    with pytest.raises(ConfigError, match=r"2 needs at least 2 ranks.*WORLD_SIZE=1.*torchrun --nproc_per_node 2") as e:
        rollout_group_ranks(1, 2)
    assert e.value.key == "engine.tp_size"


class _OneGPU:
    """torch.cuda as one device would show it (nothing runs on it)."""

    def __init__(self, monkeypatch):
        import torch

        self.set = []
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        monkeypatch.setattr(torch.cuda, "set_device", self.set.append)


@pytest.mark.parametrize("local_rank, local_world, tp, key", [(1, 2, 2, "engine.tp_size"), (1, 2, 1, "run.device")])
def test_more_ranks_than_gpus_is_a_config_error_before_any_process_group(monkeypatch, local_rank, local_world, tp, key):
    from tidal.distributed.runtime import resolve_device

    gpu = _OneGPU(monkeypatch)
    with pytest.raises(ConfigError) as e:
        resolve_device("auto", local_rank, local_world_size=local_world, tp_size=tp)
    assert e.value.key == key and "1" in e.value.message and gpu.set == []
    assert str(resolve_device("auto", 0, local_world_size=local_world, tp_size=tp)) == "cuda:0" and gpu.set == [0]


def test_init_binds_the_device_also_in_a_single_process(monkeypatch):
    """NCCL's barrier warns that its device guess "can potentially cause a hang" unless init_process_group
    got device_id: also for a world of one started without torchrun."""
    import torch.distributed as dist

    from tidal.distributed import runtime

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    _OneGPU(monkeypatch)
    seen = {}

    class Stop(Exception):
        pass

    def fake_init(backend, **kwargs):
        seen.update(kwargs, backend=backend)
        raise Stop

    for var in ("MASTER_ADDR", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(dist, "init_process_group", fake_init)
    with pytest.raises(Stop):
        runtime.init_runtime(1, "auto")
    assert seen["backend"] == "nccl" and str(seen["device_id"]) == "cuda:0"


@pytest.mark.parametrize(("cores", "ranks", "env", "setting", "want"), [
    (2, 1, None, 0, 1),  # a 2-core machine: 1 thread (2 were 20-40x slower when the machine is busy)
    (16, 1, None, 0, 8),
    (16, 2, None, 0, 4),
    (3, 4, None, 0, 1),  # never 0
    (16, 1, "3", 0, 3),  # OMP_NUM_THREADS wins over the rule
    (16, 1, "3", 5, 5),  # run.cpu_threads wins over both
])
def test_cpu_threads_rule(monkeypatch, cores, ranks, env, setting, want):
    from tidal.distributed import runtime

    monkeypatch.setattr(runtime.os, "sched_getaffinity", lambda _pid: set(range(cores)), raising=False)
    if env is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", env)
    assert runtime.cpu_threads(setting, ranks) == want


def test_set_cpu_threads_sets_torch_on_cpu_only(monkeypatch):
    import torch

    from tidal.distributed import runtime

    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(runtime.os, "sched_getaffinity", lambda _pid: set(range(8)), raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    runtime.set_cpu_threads(0, torch.device("cpu"))
    runtime.set_cpu_threads(0, torch.device("cuda", 0))
    assert calls == [2]


def test_a_cpu_run_sets_its_threads_before_building(monkeypatch, tmp_path):
    """`tidal train` on CPU calls the rule with run.cpu_threads (the RM job too)."""
    from tidal import build
    from tidal.config import load_config
    from tidal.rm import setup

    seen = []

    def stop(setting, device):
        seen.append((setting, device.type))
        raise RuntimeError("stop here")

    for module in (build, setup):
        monkeypatch.setattr(module, "set_cpu_threads", stop)
    for name, fn in (("quickstart", build.build_trainer), ("rm_quickstart", setup.build_reward_model_trainer)):
        cfg = load_config(name, [f"run.output_dir={tmp_path / name}", "run.device=cpu", "run.cpu_threads=3"])
        try:
            with pytest.raises(RuntimeError, match="stop here"):
                fn(cfg)
        finally:
            from tidal.distributed import shutdown

            shutdown()
    assert seen == [(3, "cpu"), (3, "cpu")]
