"""MetricsLogger and backends: JSONL records, log_every windows, resume truncation, rank gating, wandb."""

import io
import json
import sys
import types

import pytest
import torch
from rich.console import Console

from tidal.config_base import ConfigError, build
from tidal.logging import LoggingConfig, MetricsLogger
from tidal.logging.console import ConsoleBackend


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def jsonl_logger(tmp_path, **kw):
    cfg = LoggingConfig(backends=["jsonl"], log_every=kw.pop("log_every", 1))
    return MetricsLogger(cfg, tmp_path, is_main=kw.pop("is_main", True), total_steps=kw.pop("total_steps", 10), **kw)


def test_jsonl_one_object_per_step_with_converted_values(tmp_path):
    log = jsonl_logger(tmp_path)
    log.log(1, {"reward/mean": torch.tensor(0.5), "n": 3, "loss": float("nan")})
    log.log(2, {"reward/mean": 0.25})
    log.close()
    assert read_jsonl(tmp_path / "metrics.jsonl") == [{"step": 1, "reward/mean": 0.5, "n": 3.0, "loss": None}, {"step": 2, "reward/mean": 0.25}]


def test_log_every_writes_window_means_and_keeps_sparse_keys(tmp_path):
    log = jsonl_logger(tmp_path, log_every=3, total_steps=7)
    for step in range(1, 8):
        log.log(step, {"r": float(step), **({"eval/acc": 0.9} if step == 5 else {})})
    log.close()
    # windows 1-3, 4-6 and the last step 7
    assert read_jsonl(tmp_path / "metrics.jsonl") == [{"step": 3, "r": 2.0}, {"step": 6, "r": 5.0, "eval/acc": 0.9}, {"step": 7, "r": 7.0}]


def test_close_flushes_a_pending_window(tmp_path):
    log = jsonl_logger(tmp_path, log_every=4, total_steps=100)
    log.log(1, {"r": 1.0})
    log.log(2, {"r": 3.0})
    log.close()
    assert read_jsonl(tmp_path / "metrics.jsonl") == [{"step": 2, "r": 2.0}]


def test_resume_drops_the_crashed_tail(tmp_path):
    log = jsonl_logger(tmp_path)
    for step in range(1, 6):
        log.log(step, {"r": float(step)})
    log.close()  # "crash" after step 5; the checkpoint was at step 3
    log = jsonl_logger(tmp_path, start_step=3)
    with pytest.raises(ValueError, match="steps must increase"):
        log.log(3, {"r": 0.0})
    log.log(4, {"r": 40.0})
    log.close()
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]
    assert read_jsonl(tmp_path / "metrics.jsonl")[-1]["r"] == 40.0


def test_only_main_rank_writes(tmp_path):
    log = jsonl_logger(tmp_path / "run", is_main=False)
    log.log(1, {"r": 1.0})
    log.close()
    assert not (tmp_path / "run").exists()


def test_non_numeric_metric_is_rejected(tmp_path):
    log = jsonl_logger(tmp_path)
    with pytest.raises(TypeError, match="metric 'text' must be a number"):
        log.log(1, {"text": "hi"})


STEP = {"reward/total": 0.51234, "reward/total/count": 128.0, "reward/dropped_count": 0.0, "eval/greedy_accuracy": 0.625,
        "eval/prompts_count": 200.0, "actor/kl": 0.0012345, "response/tokens_count": 4096.0, "time/generate": 0.5,
        "time/train": 0.25, "time/weight_sync": 0.05, "time/step": 0.8, "loss": 2.0}


def test_console_one_compact_line_per_step_and_a_table_every_n(tmp_path):
    out = io.StringIO()
    console = Console(file=out, width=100, force_terminal=False)
    backend = ConsoleBackend(LoggingConfig(table_every=2), tmp_path, total_steps=5, start_step=0, hparams=None, console=console)
    for step in (1, 2, 3):
        backend.write(step, STEP)
    backend.close()
    lines = out.getvalue().splitlines()
    assert lines[0] == ("step 1/5  reward 0.512  eval acc 0.625  kl 0.00123  8192 tok/s  "
                        "0.80 s/step (generate 0.50, train 0.25, weight_sync 0.05)  about 3.20 s left")
    assert [ln.split("  ")[0] for ln in lines if ln.startswith("step ")] == ["step 1/5", "step 2/5", "step 2/5: all metrics", "step 3/5"]
    table = out.getvalue().split("step 2/5: all metrics\n", 1)[1].split("\nstep 3/5")[0].splitlines()
    assert table[0] == "  reward    total 0.512  total/count 128  dropped_count 0"
    assert "  eval      greedy_accuracy 0.625  prompts_count 200" == table[1]  # not 200.0000
    assert "generate 0.5 s" in table[4] and table[-1] == "  other     loss 2"


def test_console_table_at_the_last_step_and_never_with_0(tmp_path):
    for every, tables in ((10, 1), (0, 0)):
        out = io.StringIO()
        backend = ConsoleBackend(LoggingConfig(table_every=every), tmp_path, total_steps=3, start_step=0, hparams=None,
                                 console=Console(file=out, width=100))
        backend.write(3, STEP)
        backend.close()
        assert out.getvalue().count("all metrics") == tables


def test_console_step_line_says_the_time_left(tmp_path, monkeypatch):
    """At the first logged step: its time/step times the steps left; then the wall time per step
    since the first logged step (evaluations included); nothing at the last step."""
    clock = [100.0]
    monkeypatch.setattr("tidal.logging.console.time.monotonic", lambda: clock[0])
    out = io.StringIO()
    backend = ConsoleBackend(LoggingConfig(table_every=0), tmp_path, total_steps=10, start_step=0, hparams=None,
                             console=Console(file=out, width=200, force_terminal=False))
    for step, now in ((1, 100.0), (3, 110.0), (10, 150.0)):
        clock[0] = now
        backend.write(step, STEP)
    backend.close()
    lines = out.getvalue().splitlines()
    assert lines[0].endswith("s/step (generate 0.50, train 0.25, weight_sync 0.05)  about 7.20 s left")  # 0.8 s x 9
    assert lines[1].endswith("about 35.0 s left")  # (110 - 100) / 2 steps x 7 left
    assert lines[2].endswith("weight_sync 0.05)")


@pytest.mark.parametrize("key, value, text", [
    ("eval/prompts_count", 200.0, "200"), ("response/tokens_count", 123456.0, "123,456"), ("reward/total", 0.51234, "0.512"),
    ("actor/kl", 0.000012345, "1.23e-05"), ("x", 12345.0, "12.3k"), ("x", 2.5e6, "2.5M"), ("x", 512.0, "512"), ("x", 3.0, "3"),
    ("time/generate", 1.23456, "1.23 s"), ("x", float("nan"), "–"),
])
def test_numbers_for_people(key, value, text):
    from tidal.logging.console import format_value

    assert format_value(key, value) == text


def test_console_on_a_terminal_shows_the_phase_and_tokens_per_second(tmp_path):
    out = io.StringIO()
    console = Console(file=out, width=120, force_terminal=True)
    backend = ConsoleBackend(LoggingConfig(), tmp_path, total_steps=4, start_step=0, hparams=None, console=console)
    backend.phase_begin("generate")
    backend.phase_end("generate", 2.0)
    backend.event("generate:done", {"prompts": 2, "completion_lengths": [100, 300], "finish_reasons": ["stop", "length"]})
    task = backend._display._progress.tasks[0]
    assert task.description == "train" and task.fields["info"] == "generated 2 sequences, 200 tok/s (this rank)"
    backend.write(2, STEP)
    assert backend._display._progress.tasks[0].completed == 2
    backend.close()
    assert backend._display._progress is None  # the live display ends with its last task


def test_start_of_run_is_step_0(tmp_path):
    log = jsonl_logger(tmp_path)
    log.log_start({"eval/greedy_accuracy": 0.4})
    log.log(1, {"reward/mean": 1.0})
    with pytest.raises(ValueError, match="step 0"):
        log.log_start({"eval/greedy_accuracy": 0.5})
    log.close()
    assert read_jsonl(tmp_path / "metrics.jsonl") == [{"step": 0, "eval/greedy_accuracy": 0.4},
                                                      {"step": 1, "reward/mean": 1.0}]
    log = jsonl_logger(tmp_path)  # a fresh run in the same directory starts its record anew, step 0 too
    log.log_start({"eval/greedy_accuracy": 0.7})
    log.close()
    assert read_jsonl(tmp_path / "metrics.jsonl") == [{"step": 0, "eval/greedy_accuracy": 0.7}]


def test_tensorboard_writes_events(tmp_path):
    log = MetricsLogger(LoggingConfig(backends=["tensorboard"]), tmp_path, is_main=True, total_steps=2)
    log.log(1, {"reward/mean": 1.0})
    log.close()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("reward/mean")] == [(1, 1.0)]


@pytest.mark.parametrize("backend", ["wandb", "tensorboard"])
def test_missing_backend_package_is_a_clear_error_on_every_rank(tmp_path, monkeypatch, backend):
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)  # as if it were not installed
    with pytest.raises(ConfigError, match=rf"logging.backends.*pip install -e '\.\[{backend}\]'"):
        MetricsLogger(LoggingConfig(backends=[backend]), tmp_path, is_main=False, total_steps=1)


def test_wandb_backend_offline_run_with_stable_id(tmp_path, monkeypatch):
    calls = []

    class Run:
        def log(self, metrics, step):
            calls.append(("log", metrics, step))

        def finish(self):
            calls.append(("finish",))

    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: calls.append(("init", kw)) or Run()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setattr("importlib.util.find_spec", lambda name: object())
    monkeypatch.setattr("importlib.metadata.version", lambda dist: "0.19.0")
    for _ in range(2):
        log = MetricsLogger(LoggingConfig(backends=["wandb"], wandb_project="p"), tmp_path, is_main=True, total_steps=1, hparams={"lr": 1})
        log.log(1, {"r": 2.0})
        log.close()
    inits = [c[1] for c in calls if c[0] == "init"]
    assert inits[0]["mode"] == "offline" and inits[0]["project"] == "p" and inits[0]["config"] == {"lr": 1}
    assert inits[0]["id"] == inits[1]["id"] and inits[0]["resume"] == "allow"
    assert ("log", {"r": 2.0}, 1) in calls and calls[-1] == ("finish",)


@pytest.mark.parametrize(
    "data, key",
    [({"backends": ["console", "mlflow"]}, "logging.backends[1]"), ({"backends": ["jsonl", "jsonl"]}, "logging.backends"), ({"log_every": 0}, "logging.log_every"), ({"trajectories_every": -1}, "logging.trajectories_every")],
)
def test_config_errors_name_the_key(data, key):
    with pytest.raises(ConfigError) as e:
        build(LoggingConfig, data, prefix="logging")
    assert e.value.key == key


def test_trajectories_due():
    assert [LoggingConfig(trajectories_every=3).trajectories_due(s) for s in range(1, 7)] == [False, False, True, False, False, True]
    assert not LoggingConfig().trajectories_due(3)


def test_step_line_shows_device_memory_by_part():
    from tidal.logging.console import step_line

    m = {"time/step": 2.0, "memory/device_used_gib": 115.2, "memory/peak_allocated_gib": 40.06,
         "memory/engine_weights_gib": 0.93, "memory/engine_kv_cache_gib": 70.3}
    assert step_line(3, 10, m).endswith("mem 115.2 GiB on the device (peak alloc 40.1, engine weights 0.9, KV cache 70.3)")
    assert "mem" not in step_line(3, 10, {"time/step": 2.0})  # off CUDA: no memory figures


def test_step_line_headline_reward_is_the_trained_one():
    """reward/mean (what is trained on, an environment's reward included) leads over reward/total (the
    reward components' over valid samples): 0.47 is shown, not 0."""
    from tidal.logging.console import step_line

    assert step_line(1, 2, {"reward/total": 0.0, "reward/mean": 0.47}).startswith("step 1/2  reward 0.47")


def test_step_line_shows_the_eval_reward_without_an_accuracy():
    from tidal.logging.console import step_line

    assert "eval reward 0.7" in step_line(1, 2, {"eval/greedy_reward": 0.7})
    line = step_line(1, 2, {"eval/greedy_accuracy": 0.5, "eval/greedy_reward": 0.7})
    assert "eval acc 0.5" in line and "eval reward" not in line
