"""At start a run says where it lives (run directory, resolved config, metrics, checkpoints, how to
watch it) and writes the resolved config there; that file loads back to the same config."""

from tidal.build import build_trainer
from tidal.config import load_config
from tidal.distributed import shutdown


def test_run_announces_its_directory_and_saves_the_resolved_config(tmp_path, tiny_task_overrides, capsys):
    cfg = load_config("quickstart", tiny_task_overrides + [f"run.output_dir={tmp_path}", "logging.backends=[jsonl,tensorboard]"])
    build_trainer(cfg)
    shutdown()
    out = capsys.readouterr().out
    assert f"[tidal] run directory: {tmp_path}" in out
    assert f"resolved config: {tmp_path / 'config.yaml'}" in out and f"metrics: {tmp_path / 'metrics.jsonl'}" in out
    assert f"checkpoints: {tmp_path / 'checkpoints'}" in out
    assert f"tensorboard --logdir {tmp_path / 'tb'}" in out and f"tidal report {tmp_path}" in out
    assert load_config(str(tmp_path / "config.yaml")).to_dict() == cfg.to_dict()
