"""`tidal export --out PATH` never deletes what it did not write (issue 35 item 1): it writes a new
folder, an empty one, or one an export wrote before (recognised by its marker); it refuses the run
directory, a checkpoint and `model.path` with a one-line error (exit 2) before anything loads; a
folder holding anything else is left as it was. The written files are readable like the rest (no
0600 `model.safetensors`)."""

import json
import os
import stat
from pathlib import Path

import pytest

from tidal.cli import main
from tidal.config_base import ConfigError
from tidal.trainer.export import EXPORT_MARKER, ExportError, check_export_target, write_export


def _run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    ckpt = run / "checkpoints" / "step_000002"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer.json").write_text('{"step": 2}')
    (run / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    return run


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("where", ["run", "checkpoint", "checkpoints", "model", "unrelated", "a file", "holds the run"])
def test_export_refuses_what_it_did_not_write_and_deletes_nothing(tmp_path, capsys, where):
    run = _run_dir(tmp_path)
    ckpt = run / "checkpoints" / "step_000002"
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    unrelated = tmp_path / "photos"
    unrelated.mkdir()
    (unrelated / "holiday.jpg").write_bytes(b"\xff\xd8")
    (tmp_path / "notes.txt").write_text("mine")
    out = {"run": run, "checkpoint": ckpt, "checkpoints": run / "checkpoints", "model": model, "unrelated": unrelated,
           "a file": tmp_path / "notes.txt", "holds the run": tmp_path}[where]
    (tmp_path / "data.jsonl").write_text('{"prompt": "1+1", "label": "2"}\n')
    before = _tree(tmp_path)
    code = main(["export", "quickstart", "--checkpoint", str(ckpt), "--out", str(out), f"run.output_dir={run}",
                 f"model.path={model}", "task.name=", f"data.train=[{{path: {tmp_path / 'data.jsonl'}}}]"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("tidal: config error at '--out'") and len(err.strip().splitlines()) == 1
    assert _tree(tmp_path) == before  # nothing deleted, nothing written


def test_check_export_target_accepts_new_empty_and_marked_folders(tmp_path):
    assert check_export_target(tmp_path / "new") == (tmp_path / "new").resolve()
    (tmp_path / "empty").mkdir()
    check_export_target(tmp_path / "empty")
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / EXPORT_MARKER).write_text("{}")
    (tmp_path / "old" / "model.safetensors").write_bytes(b"x")
    check_export_target(tmp_path / "old")
    run = _run_dir(tmp_path)
    check_export_target(run / "export", run_dir=run)  # a new folder inside the run directory is fine
    with pytest.raises(ConfigError, match="inside or around"):
        check_export_target(run / "checkpoints" / "hf", protected={"the checkpoints folder": run / "checkpoints"})


def _write(folder: Path) -> None:
    (folder / "config.json").write_text("{}")
    fd = os.open(folder / "model.safetensors", os.O_WRONLY | os.O_CREAT, 0o600)  # as safetensors' temporary file is
    os.write(fd, b"weights")
    os.close(fd)


def test_write_export_replaces_only_an_earlier_export_and_files_are_readable(tmp_path):
    out = tmp_path / "hf"
    write_export(out, _write, source="checkpoint A")
    assert (out / EXPORT_MARKER).is_file() and "checkpoint A" in (out / EXPORT_MARKER).read_text()
    umask = os.umask(0)
    os.umask(umask)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert modes["model.safetensors"] == modes["config.json"] == modes[EXPORT_MARKER] == 0o666 & ~umask
    write_export(out, _write, source="checkpoint B")
    assert "checkpoint B" in (out / EXPORT_MARKER).read_text() and (out / "model.safetensors").read_bytes() == b"weights"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no temporary or replaced folder left
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "keep.txt").write_text("keep")
    with pytest.raises(ConfigError):
        write_export(mine, _write, source="checkpoint C")
    assert (mine / "keep.txt").read_text() == "keep" and sorted(p.name for p in tmp_path.iterdir()) == ["hf", "mine"]


def _write_with_adapter(folder: Path) -> None:
    _write(folder)
    (folder / "adapter").mkdir()
    (folder / "adapter" / "adapter_model.safetensors").write_bytes(b"lora")


def test_an_export_over_an_earlier_one_replaces_only_what_that_export_wrote(tmp_path):
    """Issue 44 item 6: ``--out`` over an earlier export replaced the folder wholesale: files the user
    added (``MODEL_CARD.md``, ``gguf/``) were deleted. Only the files the earlier export's manifest
    lists, bytes unchanged, are replaced or removed (its ``adapter/`` here, which this export lacks)."""
    out = tmp_path / "hf"
    write_export(out, _write_with_adapter, source="checkpoint A")
    (out / "MODEL_CARD.md").write_text("# my model")
    (out / "gguf").mkdir()
    (out / "gguf" / "model.gguf").write_bytes(b"quantized")
    write_export(out, _write, source="checkpoint B")
    assert _tree(out) == {"MODEL_CARD.md": b"# my model", "gguf/model.gguf": b"quantized", "config.json": b"{}",
                          "model.safetensors": b"weights", EXPORT_MARKER: (out / EXPORT_MARKER).read_bytes()}
    manifest = json.loads((out / EXPORT_MARKER).read_text())
    assert manifest["source"] == "checkpoint B" and sorted(manifest["files"]) == ["config.json", "model.safetensors"]


@pytest.mark.parametrize("marker", ["copied", "planted", "edited"])
def test_a_marker_that_does_not_list_a_file_never_lets_an_export_touch_it(tmp_path, marker):
    """A copied or planted ``.tidal-export`` (or a file changed since the export) deleted the whole
    folder: a file the new export would write over that the manifest does not vouch for is refused,
    with nothing in the folder changed."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_text('{"mine": true}')
    (mine / "notes.txt").write_text("keep")
    if marker == "copied":
        write_export(tmp_path / "hf", _write, source="checkpoint A")
        (mine / EXPORT_MARKER).write_bytes((tmp_path / "hf" / EXPORT_MARKER).read_bytes())
    elif marker == "planted":
        (mine / EXPORT_MARKER).write_text('{"files": {"config.json": "00000000", "../notes.txt": "00000000"}}')
    else:
        write_export(mine / "sub", _write, source="x")  # not this folder's own; then a real export, edited by the user
        mine = mine / "sub"
        (mine / "config.json").write_text('{"edited": true}')
    before = _tree(tmp_path)
    with pytest.raises(ExportError, match="which no earlier export wrote .*nothing was changed"):
        write_export(mine, _write, source="checkpoint B")
    assert _tree(tmp_path) == before
    assert not [p for p in tmp_path.rglob(".*writing-*")]  # its own copy removed


def test_a_killed_exports_hidden_copy_is_removed_by_the_next_export(tmp_path):
    """A killed export left ``.hf.writing-*`` (a whole model) behind for good."""
    out = tmp_path / "hf"
    left = tmp_path / ".hf.writing-k1ll3d"
    left.mkdir()
    (left / "model.safetensors").write_bytes(b"x" * 1000)
    other = tmp_path / ".other.writing-abc"  # another folder's: not this export's to remove
    other.mkdir()
    write_export(out, _write, source="checkpoint A")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.writing-abc", "hf"]


def test_a_failed_export_leaves_the_earlier_one(tmp_path):
    out = tmp_path / "hf"
    write_export(out, _write, source="checkpoint A")

    def fail(folder: Path) -> None:
        (folder / "config.json").write_text("{}")
        raise OSError(28, "No space left on device")

    with pytest.raises(ExportError, match=r"OSError: \[Errno 28\] No space left on device .*; the earlier export in it is as it was"):
        write_export(out, fail, source="checkpoint B")
    assert "checkpoint A" in (out / EXPORT_MARKER).read_text() and sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


@pytest.mark.parametrize("how", ["directly", "through a symlink"])
def test_run_output_dir_inside_another_runs_checkpoint_is_refused(tmp_path, how):
    """Issue 44 item 5: a run whose ``run.output_dir`` was inside another run's checkpoint wrote its
    ``config.yaml`` there: the checkpoint then failed its checksum and ``tidal eval`` refused it.
    Refused like ``export --out`` (one check, :func:`tidal.run.checkpoint.check_outside_checkpoints`)."""
    from tidal.distributed import shutdown
    from tidal.distributed.runtime import init_runtime
    from tidal.run.config import CheckpointConfig
    from tidal.run.run_dir import claim_run_dir

    ckpt = _run_dir(tmp_path) / "checkpoints" / "step_000002"
    inside = ckpt / "new_run"
    if how == "through a symlink":
        (tmp_path / "link").symlink_to(ckpt)
        inside = tmp_path / "link" / "new_run"
    before = _tree(tmp_path / "run")
    rt = init_runtime(1, "cpu")
    try:
        with pytest.raises(ConfigError) as info:
            claim_run_dir(str(inside), CheckpointConfig(), rt)
    finally:
        shutdown()
    assert info.value.key == "run.output_dir" and f"is inside the checkpoint {ckpt}" in info.value.message
    assert _tree(tmp_path / "run") == before and not (ckpt / "new_run").exists()
    with pytest.raises(ConfigError, match=f"'--out'.*is inside the checkpoint {ckpt}"):  # any run's, not only the one exported
        check_export_target(inside / "hf")


def test_a_full_disk_during_an_export_is_one_error_and_leaves_nothing(tmp_path):
    """Issue 44 item 10: safetensors' ``SafetensorError`` on a full disk came out as a raw traceback."""
    import torch
    from safetensors.torch import save_file

    from tests.faults.disks import tmpfs
    from tidal.trainer.export import ExportError

    with tmpfs(tmp_path / "disk", "1m") as disk:
        with pytest.raises(ExportError) as info:
            write_export(disk / "hf", lambda folder: save_file({"w": torch.zeros(2**20)}, str(folder / "model.safetensors")),
                         source="checkpoint A")
        message = str(info.value)
        assert message.startswith(f"writing the export {disk / 'hf'} failed: SafetensorError: ") and "the disk is full" in message
        assert "\n" not in message and list(disk.iterdir()) == []


@pytest.mark.parametrize("killed_after", [0, 1])
def test_an_export_killed_mid_swap_says_so_and_the_next_export_replaces_it(tmp_path, monkeypatch, killed_after):
    """Issue 51 item 6: killed after the manifest, before the weights, the folder held step-6 weights
    under a manifest naming step 8, and the next export refused with "holds model.safetensors, which
    no earlier export wrote". Killed after any number of swapped files, the manifest names the swap
    as unfinished (never one step over another's weights), and the next export replaces it."""
    out = tmp_path / "hf"
    write_export(out, lambda f: ((f / "config.json").write_text("{}"), (f / "model.safetensors").write_bytes(b"step 6")),
                 source="checkpoint step_000006")
    (out / "MODEL_CARD.md").write_text("# mine")
    real_replace, swapped = os.replace, []

    def killed(src, dst):
        if Path(dst).parent == out and Path(dst).name != EXPORT_MARKER:
            if len(swapped) == killed_after:
                raise KeyboardInterrupt  # the export's process ends here: nothing after it runs
            swapped.append(Path(dst).name)
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        write_export(out, lambda f: ((f / "config.json").write_text('{"a": 1}'), (f / "model.safetensors").write_bytes(b"step 8")),
                     source="checkpoint step_000008")
    monkeypatch.setattr(os, "replace", real_replace)
    manifest = json.loads((out / EXPORT_MARKER).read_text())
    assert manifest["source"].startswith("unfinished: an export of checkpoint step_000008 was replacing the export of "
                                         "checkpoint step_000006 here"), manifest
    write_export(out, lambda f: ((f / "config.json").write_text('{"a": 1}'), (f / "model.safetensors").write_bytes(b"step 8")),
                 source="checkpoint step_000008")
    assert _tree(out) == {"MODEL_CARD.md": b"# mine", "config.json": b'{"a": 1}', "model.safetensors": b"step 8",
                          EXPORT_MARKER: (out / EXPORT_MARKER).read_bytes()}
    assert json.loads((out / EXPORT_MARKER).read_text())["source"] == "checkpoint step_000008"
