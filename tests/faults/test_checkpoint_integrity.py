"""Checkpoints that are damaged or crafted, and a disk that really fills up.

- A corrupt newest checkpoint (truncated or missing shard, unreadable metadata, bad trainer.json,
  unreadable RNG file): ``resume: auto`` falls back to the newest loadable one and warns naming what
  it skipped; an explicit path is a ConfigError at ``checkpoint.resume`` naming what is wrong; a
  checkpoint that passes the cheap checks but fails to load is skipped the same way by ``load_resume``.
- A crafted checkpoint (a pickle that runs code in ``.metadata``, in a non-tensor item of a shard or
  in an RNG file) runs nothing: every read is allow-listed or ``weights_only=True``.
- A real ENOSPC (a small tmpfs) mid-save: the next run settles the partial save before probing the
  directory, so it is not refused; the free-space check counts the ``keep`` checkpoints that coexist
  with the one being written.
"""

import json
import pathlib
import pickle
import random
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from tidal.config_base import ConfigError
from tidal.distributed.runtime import init_runtime, shutdown
from tidal.run import checkpoint as ckpt
from tests.faults.old_checkpoints import as_saved_before_checksums

from tests.faults.disks import tmpfs


def _state(value: float) -> dict:
    return {"m": {"w": torch.full((64,), value), "hp": {"lr": value, "betas": (0.9, 0.99)}}}


def _trainer_state(step: int) -> dict:
    return {"step": step, "sampler": {"epoch": 0}, "algorithm": {}, "trainer": {}}


def _save_steps(root: Path, steps, keep: int = 10) -> None:
    rt = init_runtime(1, "cpu")
    try:
        for s in steps:
            ckpt.save_checkpoint(root, s, model_states=_state(float(s)), trainer_state=_trainer_state(s), runtime=rt, keep=keep)
    finally:
        shutdown()


def _fresh() -> dict:
    return {"m": {"w": torch.zeros(64), "hp": {"lr": 0.0, "betas": (0.0, 0.0)}}}


def _shard(path: Path) -> Path:
    (shard,) = sorted((path / "models").glob("*.distcp"))
    return shard


def _truncate(path: Path) -> str:
    shard = _shard(path)
    shard.write_bytes(shard.read_bytes()[:100])
    return "truncated shard models/__0_0.distcp (100 bytes"


def _missing_shard(path: Path) -> str:
    _shard(path).unlink()
    return "missing shard models/__0_0.distcp"


def _bad_metadata(path: Path) -> str:
    md = path / "models" / ".metadata"
    md.write_bytes(md.read_bytes()[:40])
    return "models/.metadata cannot be read"


def _no_metadata(path: Path) -> str:
    (path / "models" / ".metadata").unlink()
    return "no models/.metadata"


def _bad_trainer_json(path: Path) -> str:
    (path / "trainer.json").write_text('{"step": 3, "sampler": ')
    return "trainer.json is not valid JSON"


def _trainer_json_lacks_keys(path: Path) -> str:
    (path / "trainer.json").write_text('{"sampler": {}}')
    return "trainer.json lacks ['step']"


def _bad_rng(path: Path) -> str:
    (path / "rng_rank0.pt").write_bytes(b"not a torch file")
    return "rng_rank0.pt cannot be read"


CORRUPTIONS = [_truncate, _missing_shard, _bad_metadata, _no_metadata, _bad_trainer_json, _trainer_json_lacks_keys, _bad_rng]


@pytest.mark.parametrize("corrupt", CORRUPTIONS, ids=lambda f: f.__name__.strip("_"))
def test_corrupt_newest_checkpoint(tmp_path, capsys, corrupt):
    root = tmp_path / "checkpoints"
    _save_steps(root, [1, 2, 3])
    newest = root / "step_000003"
    problem = corrupt(newest)
    # auto: the newest loadable one, with a warning naming what was skipped and why
    assert ckpt.resolve_resume("auto", root) == root / "step_000002"
    err = capsys.readouterr().err
    assert f"checkpoint.resume=auto skips {newest}: {problem}" in err, err
    path, states, st = ckpt.load_resume("auto", root, model_states=_fresh, rank=0)
    assert path == root / "step_000002" and st["step"] == 2 and torch.equal(states["m"]["w"], torch.full((64,), 2.0))
    # an explicit path: a ConfigError naming the checkpoint and the problem
    with pytest.raises(ConfigError) as info:
        ckpt.resolve_resume(str(newest), root)
    assert info.value.key == "checkpoint.resume" and str(newest) in info.value.message and problem in info.value.message


def test_a_job_names_the_keys_its_trainer_json_needs(tmp_path, capsys):
    root = tmp_path / "checkpoints"
    _save_steps(root, [1, 2])
    (root / "step_000002" / "trainer.json").write_text('{"step": 2, "sampler": {}}')
    assert ckpt.resolve_resume("auto", root) == root / "step_000002"  # step is all a resume needs by default
    assert ckpt.resolve_resume("auto", root, required_keys=ckpt.TRAINER_STATE_KEYS) == root / "step_000001"
    assert "trainer.json lacks ['algorithm', 'trainer']" in capsys.readouterr().err


def test_every_checkpoint_corrupt_means_no_resume(tmp_path, capsys):
    root = tmp_path / "checkpoints"
    _save_steps(root, [1, 2])
    _truncate(root / "step_000001")
    _bad_rng(root / "step_000002")
    assert ckpt.resolve_resume("auto", root) is None
    assert ckpt.load_resume("auto", root, model_states=_fresh, rank=0) is None
    assert capsys.readouterr().err.count("checkpoint.resume=auto skips") == 4  # each, by each call


def _spoil_bytes_item(path: Path) -> None:
    """Overwrite the bytes of the non-tensor item m.hp.lr (a torch.save blob in the shard), keeping the
    shard's size: the cheap checks pass, loading fails."""
    md = ckpt.read_dcp_metadata(path / "models")
    (info,) = [v for k, v in md.storage_data.items() if k.fqn == "m.hp.lr"]
    shard = path / "models" / info.relative_path
    data = bytearray(shard.read_bytes())
    data[info.offset : info.offset + info.length] = b"\x00" * info.length
    shard.write_bytes(bytes(data))


def test_checkpoint_that_fails_to_load_is_skipped_under_auto(tmp_path, capsys):
    root = tmp_path / "checkpoints"
    _save_steps(root, [1, 2])
    _spoil_bytes_item(root / "step_000002")
    as_saved_before_checksums(root / "step_000002")  # only loading finds it
    assert ckpt.checkpoint_problems(root / "step_000002") == []  # looks fine ...
    path, states, st = ckpt.load_resume("auto", root, model_states=_fresh, rank=0)  # ... but does not load
    assert path == root / "step_000001" and st["step"] == 1 and states["m"]["hp"]["lr"] == 1.0
    assert f"checkpoint.resume=auto skips {root / 'step_000002'}: loading failed: " in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"'checkpoint.resume'.*step_000002' cannot be loaded: "):
        ckpt.load_resume(str(root / "step_000002"), root, model_states=_fresh, rank=0)


# ---- crafted checkpoints run no code ----------------------------------------------------------------


class _Payload:
    """Unpickling this creates the file ``marker`` (a stand-in for any code a crafted file could run)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


def _load_step(root: Path, step: int = 1):
    return ckpt.load_checkpoint(root / f"step_{step:06d}", model_states=_fresh(), rank=0)


def test_crafted_rng_file_runs_no_code(tmp_path):
    root, marker = tmp_path / "checkpoints", tmp_path / "pwned"
    _save_steps(root, [1])
    torch.save({"python": random.getstate(), "numpy": None, "torch": _Payload(marker)}, root / "step_000001" / "rng_rank0.pt")
    with pytest.raises(pickle.UnpicklingError):
        _load_step(root)
    assert not marker.exists()
    assert any("rng_rank0.pt cannot be read" in p for p in ckpt.checkpoint_problems(root / "step_000001"))
    assert not marker.exists()


def test_crafted_metadata_runs_no_code(tmp_path):
    root, marker = tmp_path / "checkpoints", tmp_path / "pwned"
    _save_steps(root, [1])
    (root / "step_000001" / "models" / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    assert ckpt.checkpoint_problems(root / "step_000001")[0].startswith("models/.metadata cannot be read (UnpicklingError: 'pathlib.Path.touch' is not allowed")
    with pytest.raises(ckpt.CheckpointLoadError, match="'pathlib.Path.touch' is not allowed in checkpoint metadata"):
        _load_step(root)
    assert not marker.exists()


def test_crafted_shard_item_runs_no_code(tmp_path):
    root, marker = tmp_path / "checkpoints", tmp_path / "pwned"
    _save_steps(root, [1])
    models = root / "step_000001" / "models"
    for f in models.iterdir():
        f.unlink()
    dcp.save({"m": {"w": torch.zeros(64), "hp": _Payload(marker)}}, checkpoint_id=str(models), no_dist=True)
    assert not marker.exists()
    with pytest.raises(ckpt.CheckpointLoadError, match=r"cannot load .*models: rank 0: UnpicklingError: Weights only load failed"):
        _load_step(root)
    assert not marker.exists()


def test_rng_state_round_trip_and_old_format(tmp_path):
    path = tmp_path / "rng.pt"
    random.seed(3), np.random.seed(3), torch.manual_seed(3)
    torch.save(ckpt.rng_state(), path)
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    ckpt.set_rng_state(ckpt.load_rng_file(path))
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected
    # an RNG file written before the states were stored as tensors (numpy's array pickled) still loads
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    torch.save({"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}, path)
    expected = np.random.rand()
    np.random.seed(0)
    ckpt.set_rng_state(ckpt.load_rng_file(path))
    assert np.random.rand() == expected


def test_no_unsafe_torch_load_in_the_repository():
    repo = Path(__file__).resolve().parents[2]
    hits = [f"{p.relative_to(repo)}:{i}" for d in ("tidal", "tests", "bench") for p in (repo / d).rglob("*.py")
            for i, line in enumerate(p.read_text().splitlines(), 1) if "weights_only=" + "False" in line]
    assert hits == [], hits


# ---- a disk that really fills up ---------------------------------------------------------------------




def test_real_enospc_mid_save_names_the_full_disk_and_frees_it(tmp_path):
    with tmpfs(tmp_path / "disk", "2m") as disk:
        root = ckpt.checkpoint_root(str(disk / "run"))
        _save_steps(root, [1])
        rt = init_runtime(1, "cpu")
        try:  # 4 MiB of shards on a 2 MiB disk: the kernel's ENOSPC surfaces as a torch zip-writer error
            with pytest.raises(ckpt.CheckpointSaveError, match=r"saving checkpoint step 2 into .*step_000002.tmp failed: rank 0: .*"
                               r"\(0.00 GiB were free on its filesystem -- the disk is full\); the previous checkpoint is intact"):
                ckpt.save_checkpoint(root, 2, model_states={"m": {"w": torch.zeros(1 << 20)}}, trainer_state=_trainer_state(2), runtime=rt, keep=2)
        finally:
            shutdown()
        assert sorted(p.name for p in root.iterdir()) == ["step_000001"]  # the partial save is gone, its space free
        ckpt.check_writable(root, rank=0)
        assert ckpt.resolve_resume("auto", root) == root / "step_000001"


def test_partial_save_that_filled_the_disk_does_not_refuse_the_rerun(tmp_path):
    """A save killed after filling the disk (here: a shard written until the kernel said ENOSPC)."""
    with tmpfs(tmp_path / "disk", "2m") as disk:
        out = disk / "run"
        root = ckpt.checkpoint_root(str(out))
        _save_steps(root, [1])
        (root / "step_000002.tmp" / "models").mkdir(parents=True)
        with pytest.raises(OSError, match="No space left on device"), open(root / "step_000002.tmp" / "models" / "__0_0.distcp", "wb") as f:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        # the old order (probe, then settle) refuses the rerun: the partial save holds the space
        with pytest.raises(ConfigError, match="No space left on device"):
            ckpt.check_writable(out, rank=0)
        assert ckpt.settle_and_probe(str(out), rank=0, checkpoints=True, barrier=lambda: None) == ["step_000002.tmp"]
        _, states, st = ckpt.load_resume("auto", root, model_states=_fresh, rank=0)
        assert st["step"] == 1 and torch.equal(states["m"]["w"], torch.full((64,), 1.0))


def test_free_space_check_counts_the_kept_checkpoints(tmp_path):
    with tmpfs(tmp_path / "disk", "1m") as disk:
        root = disk / "checkpoints"
        root.mkdir()
        per = 300 * 1024
        ckpt.check_free_space(root, per, keep=2)  # 3 x 300 KiB (2 kept + the one being written) fit in 1 MiB
        with pytest.raises(ConfigError) as info:
            ckpt.check_free_space(root, per, keep=3)  # 4 x 300 KiB do not, though one would
        assert info.value.key == "run.output_dir" and "(4 x 0.00 GiB" in info.value.message and "checkpoint.keep=3" in info.value.message
        # checkpoints already there take their space already: with 2 of them, keep=2 needs room for 1 more
        for s in (1, 2):
            (root / f"step_{s:06d}").mkdir()
            (root / f"step_{s:06d}" / "trainer.json").write_text("{}")
            (root / f"step_{s:06d}" / "blob").write_bytes(b"\0" * per)
        ckpt.check_free_space(root, per, keep=2)
        with pytest.raises(ConfigError, match=r"\(2 x .* beside the 2 already there"):
            ckpt.check_free_space(root, per, keep=3)


# ---- through the trainer ------------------------------------------------------------------------------


@pytest.mark.slow
def test_training_resumes_past_a_truncated_newest_checkpoint(tmp_path, tiny_task_overrides, capsys):
    from tidal import cli
    from tidal.config import load_config
    from tidal.build import build_trainer

    out = tmp_path / "run"
    common = tiny_task_overrides + [f"run.output_dir={out}", "checkpoint.every=1", "checkpoint.keep=5"]
    try:
        build_trainer(load_config("quickstart", common + ["run.steps=2"])).fit()
    finally:
        shutdown()
    newest = out / "checkpoints" / "step_000002"
    _truncate(newest)
    capsys.readouterr()
    # an explicit path: exit 2, one line naming the key, the checkpoint and the problem, before any model loads
    assert cli.main(["train", "quickstart", *common, "run.steps=3", f"checkpoint.resume={newest}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("tidal: config error at 'checkpoint.resume'") and "truncated shard models/__0_0.distcp" in err[-1], err
    # auto: resumes from step 1, says what it skipped, and trains steps 2 and 3 again
    try:
        build_trainer(load_config("quickstart", common + ["run.steps=3"])).fit()
    finally:
        shutdown()
    captured = capsys.readouterr()
    assert captured.err.count(f"checkpoint.resume=auto skips {newest}: truncated shard") == 1  # once (issue 35 item 9)
    assert f"resumed from {out / 'checkpoints' / 'step_000001'} (step 1)" in captured.out
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3], steps


@pytest.mark.slow
def test_ranks_agree_when_one_rank_fails_to_load(tmp_path):
    """A checkpoint that only rank 1 cannot load: every rank skips it and loads the same older one."""
    repo = Path(__file__).resolve().parents[2]
    env = dict(__import__("os").environ, OMP_NUM_THREADS="1", PYTHONPATH=str(repo))
    cmd = [__import__("sys").executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(repo / "tests" / "faults" / "scripts" / "resume_agree.py"), str(tmp_path / "checkpoints")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    for r in (0, 1):
        assert f"RESUMED rank {r} step 1 w 1.0 lr 1.0" in proc.stdout, proc.stdout
    assert "checkpoint.resume=auto skips" in proc.stderr and "step_000002: loading failed: rank 1: " in proc.stderr, proc.stderr[-3000:]
