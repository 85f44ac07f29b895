"""The task build follows the run's thread rule (issue 44 item 11): ``task.sft_threads: 0`` (the
default) builds with ``run.cpu_threads``'s threads, and Tidal makes torch's OpenMP threads sleep
rather than spin while they wait, so a second thread on a busy machine costs little instead of
making each SFT step 6-9x slower. The timing itself is measured by ``bench/busy_threads.py``: on a
machine shared with other work a steps/s ratio swings too much to assert in the suite."""

import json
import os
import subprocess
import time
import sys
from pathlib import Path

import pytest
import torch

from tidal.config import load_config
from tidal.tasks import TaskConfig, prepare
from tidal.tasks import assets as assets_module
from tidal.tasks.sft import build_threads

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def two_cores(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})


@pytest.mark.parametrize(("sft_threads", "run_threads", "expected"), [(0, 0, 1), (0, 3, 3), (2, 0, 2), (2, 3, 2)])
def test_build_threads_follow_the_run_rule_unless_set(two_cores, sft_threads, run_threads, expected):
    before = torch.get_num_threads()
    with build_threads(sft_threads, run_threads) as n:
        assert n == expected and torch.get_num_threads() == expected
    assert torch.get_num_threads() == before


def test_build_threads_are_restored_on_error(two_cores):
    before = torch.get_num_threads()
    with pytest.raises(RuntimeError, match="boom"), build_threads(3):
        raise RuntimeError("boom")
    assert torch.get_num_threads() == before


def test_the_quickstart_builds_with_the_runs_threads(two_cores, tmp_path, monkeypatch):
    """The shipped quickstart leaves task.sft_threads at 0; its build runs with run.cpu_threads's threads."""
    cfg = load_config("quickstart", [f"task.workdir={tmp_path}"])
    assert cfg.task.sft_threads == 0 and TaskConfig().sft_threads == 0
    seen = []

    def model_seen(task, tokenizer, **_):
        seen.append(torch.get_num_threads())
        raise RuntimeError("stop after the thread count is known")

    monkeypatch.setattr(assets_module, "build_model", model_seen)
    small = TaskConfig(name="arithmetic", workdir=str(tmp_path), digits=1, num_train=8, num_eval=2)
    for run_threads, expected in ((0, 1), (2, 2)):
        with pytest.raises(RuntimeError, match="thread count"):
            prepare(small, run_threads=run_threads)
    assert seen == [1, 2]


def test_importing_tidal_makes_waiting_openmp_threads_sleep():
    """libgomp spins 300,000 times in every wait unless OMP_WAIT_POLICY says passive before torch loads;
    Tidal sets it (an explicit setting wins)."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    libgomp = next((Path(torch.__file__).parent / "lib").glob("libgomp*.so*"))  # what torch loads, without torch's import time
    script = f"import ctypes, tidal; ctypes.CDLL({str(libgomp)!r})"
    shown = subprocess.run([sys.executable, "-c", script], env=dict(env, OMP_DISPLAY_ENV="VERBOSE", PYTHONPATH=str(REPO)),
                           capture_output=True, text=True, timeout=120).stderr
    assert "GOMP_SPINCOUNT = '0'" in shown, shown[-2000:]


def test_importing_tidal_keeps_transformers_off_the_hub_for_kernels():
    """transformers 5.x fetches kernels from the Hub unless USE_HUB_KERNELS says no: Tidal sets it
    before transformers loads (an explicit setting wins), so an offline GPU machine loads models."""
    env = {k: v for k, v in os.environ.items() if k != "USE_HUB_KERNELS"}
    for given, want in ((None, "NO"), ("YES", "YES")):
        run_env = dict(env, PYTHONPATH=str(REPO), **({"USE_HUB_KERNELS": given} if given else {}))
        out = subprocess.run([sys.executable, "-c", "import tidal, os; print(os.environ['USE_HUB_KERNELS'])"], env=run_env,
                             capture_output=True, text=True, timeout=120).stdout.split()
        assert out == [want], out


def test_the_builds_progress_counts_every_phase(tmp_path, monkeypatch, capsys):
    """The build's own line counts the SFT steps of both phases, so its remaining time is the
    build's, not the current phase's (off a terminal: the plain lines)."""
    from tidal.logging import progress
    from tidal.tasks import sft

    monkeypatch.setattr(progress, "PLAIN_FIRST_S", 0.0)
    monkeypatch.setattr(progress, "PLAIN_EVERY_S", 0.05)
    monkeypatch.setattr(sft, "_sft_step", lambda *a, **kw: (time.sleep(0.06), 1.0)[1])
    prepare(TaskConfig(name="arithmetic", workdir=str(tmp_path), digits=1, num_train=8, num_eval=2, hidden_size=16, num_layers=1,
                       num_heads=2, num_kv_heads=1, intermediate_size=32, sft_steps=3, sft_mistake_steps=2, sft_threads=1))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[tidal] building the 'arithmetic' task: ")]
    counted = [line for line in lines if "/5 SFT steps" in line and "left" in line]
    assert any(line.split(": ")[1].startswith(("1/5", "2/5", "3/5")) for line in counted), lines  # in phase 1, phase 2 still counted
    assert lines[-1].startswith("[tidal] building the 'arithmetic' task: done in "), lines


SMALL = dict(name="arithmetic", digits=1, num_train=20, num_eval=4, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
             intermediate_size=32, sft_steps=4, sft_mistake_steps=3, sft_batch_size=4, sft_threads=1)


def test_a_build_stopped_in_phase_2_continues_from_phase_1_and_equals_an_uninterrupted_one(tmp_path, monkeypatch, capsys):
    """Ctrl-C in the second warm-start phase (issue 44 item 12): BuildStopped says what is kept; the
    rerun trains phase 2 only and builds the same assets as a build never stopped."""
    from safetensors.torch import load_file

    from tidal.tasks import sft
    from tidal.tasks.store import BuildStopped, asset_dir, phases_dir

    reference = prepare(TaskConfig(**SMALL, workdir=str(tmp_path / "ref")))
    cfg = TaskConfig(**SMALL, workdir=str(tmp_path / "stop"))
    step, calls = sft._sft_step, []

    def counted(*args, **kw):
        calls.append(1)
        if len(calls) == 6 and stop_at_6:  # the second step of phase 2
            raise KeyboardInterrupt
        return step(*args, **kw)

    monkeypatch.setattr(sft, "_sft_step", counted)
    stop_at_6 = True
    with pytest.raises(BuildStopped) as stopped:
        prepare(cfg)
    root = asset_dir(cfg, cfg.workdir)
    assert str(stopped.value) == (f"stopped by SIGINT while building the task {root.name}; its finished phase(s) 1 are kept "
                                  f"in {phases_dir(root)}: rerun the same command to continue")
    assert not root.exists() and sorted(os.listdir(phases_dir(root))) == ["1"]
    stop_at_6, calls[:] = False, []
    capsys.readouterr()
    assets = prepare(cfg)
    assert len(calls) == 3 and f"continuing from phase 1 of a stopped build ({phases_dir(root) / '1'})" in capsys.readouterr().out
    assert not phases_dir(root).exists() and sorted(os.listdir(tmp_path / "stop")) == [root.name]
    assert assets.sft_accuracy == reference.sft_accuracy
    ours, theirs = load_file(f"{assets.model_path}/model.safetensors"), load_file(f"{reference.model_path}/model.safetensors")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    def results(a):  # the marker's losses and accuracies (not where or how long)
        return {k: v for k, v in json.loads(Path(a.model_path).parent.joinpath("task.json").read_text()).items()
                if k not in ("settings", "build_seconds")}

    assert results(assets) == results(reference) and "mistake_loss" in results(assets)


def test_the_calculator_builds_evaluation_uses_the_cache_name_of_its_transformers(monkeypatch):
    """Issue 44 item 15: the calculator build's evaluation (HFEngine's decode loop) passed and read
    `past_key_values`, which transformers 5 renamed: a deprecation warning on every build."""
    import logging

    from transformers.utils import logging as hf_logging

    from tests.engine.helpers import tiny_hf
    from tidal.engine.base import SamplingParams
    from tidal.engine.config import EngineConfig
    from tidal.engine.hf import HFEngine

    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logger = hf_logging.get_logger("transformers")
    logger.addHandler(handler)
    hf_logging.warning_once.cache_clear()  # a warning said earlier in this process is said again
    try:
        hf = tiny_hf("qwen2", seed=0)
        engine = HFEngine(hf.config, EngineConfig(backend="hf"), device=torch.device("cpu"), dtype=torch.float32)
        engine.load_weights([(n, p.detach().clone()) for n, p in hf.named_parameters()])
        done = engine.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_new_tokens=3, ignore_eos=True))
    finally:
        logger.removeHandler(handler)
    assert len(done[0].token_ids) == 3
    assert not [m for m in said if "past_key_values" in m], said
