"""Corrupt or non-finite weights (issue 35 item 4): flipped bytes in a shard (the sizes still
match, so the cheap checks pass) fail their checksum, and NaN weights are found after the load;
under ``checkpoint.resume: auto`` either checkpoint is skipped with a warning naming why and the
older one loads, an explicit path is a ConfigError naming it. A run whose weights turn NaN stops
before the save, so the last good checkpoint is never rotated away."""

from pathlib import Path

import pytest
import torch

from tests.torchrun_scripts import run_ranks
from tidal.config_base import ConfigError
from tidal.distributed.runtime import init_runtime, shutdown
from tidal.run import checkpoint as ckpt


def _state(value: float) -> dict:
    return {"m": {"w": torch.full((64,), value), "hp": {"lr": 1.0}}}


def _save(root: Path, values: dict[int, float]) -> None:
    rt = init_runtime(1, "cpu")
    try:
        for step, v in values.items():
            ckpt.save_checkpoint(root, step, model_states=_state(v), runtime=rt, keep=10,
                                 trainer_state={"step": step, "sampler": {}, "algorithm": {}, "trainer": {}})
    finally:
        shutdown()


def _fresh() -> dict:
    return _state(0.0)


def _flip_a_weight_byte(path: Path) -> None:
    md = ckpt.read_dcp_metadata(path / "models")
    (info,) = [v for k, v in md.storage_data.items() if k.fqn == "m.w"]
    shard = path / "models" / info.relative_path
    data = bytearray(shard.read_bytes())
    data[info.offset + info.length - 2] ^= 0x01  # a finite weight changes a little
    shard.write_bytes(bytes(data))


def test_flipped_bytes_fail_their_checksum_and_auto_falls_back(tmp_path, capsys):
    root = tmp_path / "checkpoints"
    _save(root, {1: 1.0, 2: 2.0})
    newest = root / "step_000002"
    _flip_a_weight_byte(newest)
    assert ckpt.checkpoint_problems(newest) == []  # the sizes match: only the checksum sees it
    path, states, st = ckpt.load_resume("auto", root, model_states=_fresh, rank=0)
    assert path == root / "step_000001" and st["step"] == 1 and torch.equal(states["m"]["w"], torch.full((64,), 1.0))
    err = capsys.readouterr().err
    assert f"checkpoint.resume=auto skips {newest}: models/__0_0.distcp fails its checksum" in err, err
    with pytest.raises(ConfigError, match=r"step_000002' cannot be loaded: models/__0_0.distcp fails its checksum"):
        ckpt.load_resume(str(newest), root, model_states=_fresh, rank=0)


def test_a_checkpoint_this_version_wrote_without_checksums_is_incomplete(tmp_path, capsys):
    """Issue 44 item 4: with ``checksums.json`` removed, flipped bytes loaded silently (a misleading
    ``WeightSyncError`` later, no fall-back). This version writes it before ``trainer.json``: a
    checkpoint without it is incomplete, skipped by the cheap checks like a corrupt one."""
    root = tmp_path / "checkpoints"
    _save(root, {1: 1.0, 2: 2.0})
    newest = root / "step_000002"
    _flip_a_weight_byte(newest)
    (newest / ckpt.CHECKSUMS).unlink()
    why = "no checksums.json (the save that wrote trainer.json writes it first: the checkpoint is incomplete or was altered)"
    assert ckpt.checkpoint_problems(newest) == [why]
    path, states, st = ckpt.load_resume("auto", root, model_states=_fresh, rank=0)
    assert path == root / "step_000001" and st["step"] == 1 and torch.equal(states["m"]["w"], torch.full((64,), 1.0))
    assert f"checkpoint.resume=auto skips {newest}: {why}" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"step_000002' cannot be loaded: no checksums.json"):
        ckpt.load_resume(str(newest), root, model_states=_fresh, rank=0)


def test_nan_weights_in_a_checkpoint_are_skipped_under_auto(tmp_path, capsys):
    root = tmp_path / "checkpoints"
    _save(root, {1: 1.0, 2: float("nan")})
    newest = root / "step_000002"
    path, states, st = ckpt.load_resume("auto", root, model_states=_fresh, rank=0)
    assert path == root / "step_000001" and st["step"] == 1 and torch.equal(states["m"]["w"], torch.full((64,), 1.0))
    assert f"checkpoint.resume=auto skips {newest}: its weights hold NaN/Inf (m.w)" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"step_000002' cannot be loaded: its weights hold NaN/Inf \(m.w\)"):
        ckpt.load_resume(str(newest), root, model_states=_fresh, rank=0)


def test_nonfinite_names_sees_nested_and_sharded_tensors():
    states = {"a": {"w": torch.tensor([1.0, float("inf")]), "ids": torch.tensor([1, 2])}, "b": [torch.zeros(2), torch.full((2,), float("nan"))],
              "lr": 1.0}
    assert ckpt.nonfinite_names(states) == ["a.w", "b.1"]
    assert ckpt.nonfinite_names({"w": torch.zeros(3), "e": torch.empty(0)}) == []


@pytest.mark.slow  # about 15 s: a 3-step RL run on the tiny task
def test_nan_weights_stop_the_run_before_the_save_and_keep_the_last_good_checkpoint(tmp_path, tiny_task_overrides):
    from tidal.build import build_trainer
    from tidal.config import load_config

    out = tmp_path / "run"
    cfg = load_config("quickstart", tiny_task_overrides + [f"run.output_dir={out}", "checkpoint.every=1", "checkpoint.keep=1",
                                                           "sync.verify=false", "run.steps=3"])
    try:
        trainer = build_trainer(cfg)
        step_of = trainer.train_step

        def broken_at_3(step):  # the update of step 3 leaves NaN weights (what a bad update or bit rot gives)
            metrics = step_of(step)
            if step == 3:
                with torch.no_grad():
                    next(trainer.models.actor.model.parameters()).fill_(float("nan"))
            return metrics

        trainer.train_step = broken_at_3
        with pytest.raises(ckpt.NonFiniteWeightsError) as info:
            trainer.fit()
    finally:
        shutdown()
    kept = out / "checkpoints" / "step_000002"
    assert "hold NaN/Inf after step 3 (actor." in str(info.value), info.value
    assert f"no checkpoint of them is written and the newest complete checkpoint, {kept}, is kept" in str(info.value)
    assert ckpt.complete_checkpoints(out / "checkpoints") == [kept]


@pytest.mark.slow  # a 2-step RL run on the tiny task, twice
@pytest.mark.parametrize("verify", ["true", "false"])
def test_an_update_that_leaves_nan_weights_is_named_before_the_engine_gets_them(tmp_path, tiny_task_overrides, verify):
    """Issue 44 item 7: weights an update left NaN surfaced as ``WeightSyncError ... stale weights``
    (``sync.verify``) or as ``index -1024 is out of bounds`` in the sampler (without it): the
    :class:`NonFiniteWeightsError` built for it names the step and the first such parameter."""
    from tidal.build import build_trainer
    from tidal.config import load_config

    cfg = load_config("quickstart", tiny_task_overrides + [f"run.output_dir={tmp_path / 'run'}", f"sync.verify={verify}",
                                                           "run.steps=3", "checkpoint.every=0"])  # no save finds them first
    try:
        trainer = build_trainer(cfg)
        train, calls = trainer.updater.train, []

        def nan_at_2(exp, **kw):  # the second update leaves NaN weights (what an overflowing update gives)
            result = train(exp, **kw)
            calls.append(1)
            if len(calls) == 2:
                with torch.no_grad():
                    dict(trainer.models.actor.model.named_parameters())["model.norm.weight"].fill_(float("nan"))
            return result

        trainer.updater.train = nan_at_2
        with pytest.raises(ckpt.NonFiniteWeightsError) as info:
            trainer.fit()
    finally:
        shutdown()
    message = str(info.value)
    assert message.startswith("the trained weights hold NaN/Inf after step 2 (actor.model.norm.weight on rank 0)"), message
    assert "no checkpoint of them is written and no earlier checkpoint exists" in message


@pytest.mark.slow  # about 20 s: two ranks under torchrun
def test_two_ranks_agree_on_nonfinite_and_corrupt_weights(tmp_path):
    script = Path(__file__).resolve().parent / "scripts" / "weights_agree.py"
    ranks = run_ranks(script, tmp_path)
    for r, got in enumerate(ranks):
        assert "hold NaN/Inf after step 2" in got["refused"], got  # both ranks stop, also rank 0 whose weights are fine
        assert got["kept"] == ["step_000001"], got
        assert got["step"] == 1 and got["w"] == 1.0, got
