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


def test_console_prints_grouped_table_and_progress(tmp_path):
    out = io.StringIO()
    console = Console(file=out, width=100, force_terminal=False)
    backend = ConsoleBackend(LoggingConfig(), tmp_path, total_steps=4, start_step=0, hparams=None, console=console)
    backend.write(2, {"reward/mean": 0.51234, "reward/std": 0.1, "loss": 2.0})
    backend.close()
    text = out.getvalue()
    assert "step 2/4" in text and "mean 0.5123" in text and "std 0.1" in text
    assert any(line.split()[:2] == ["other", "loss"] for line in text.splitlines())
    assert "2/4" in text.splitlines()[-1]  # the progress bar's final render


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
    with pytest.raises(ConfigError, match=rf"logging.backends.*pip install 'tidal-rft\[{backend}\]'"):
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
