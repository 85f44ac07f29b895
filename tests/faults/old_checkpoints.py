"""Checkpoints as an earlier Tidal wrote them, for the tests of what loading alone finds."""

import json
from pathlib import Path

from tidal.run import checkpoint as ckpt


def as_saved_before_checksums(path: Path) -> None:
    """Make checkpoint ``path`` look saved before checksums existed: no ``checksums.json`` and no
    ``checkpoint_format`` in ``trainer.json`` (only loading it finds a spoiled shard)."""
    (path / ckpt.CHECKSUMS).unlink()
    state = json.loads((path / ckpt.COMPLETE_MARKER).read_text())
    del state[ckpt.FORMAT_KEY]
    (path / ckpt.COMPLETE_MARKER).write_text(json.dumps(state))
