"""Third-party noise kept off the console of a run (``tidal train``/``eval``/``export``/``check``).

- transformers' and huggingface_hub's progress bars (loading a model's weights, writing its shards):
  Tidal says what it loads and writes in its own lines (:mod:`tidal.logging.progress`). Set
  ``HF_HUB_DISABLE_PROGRESS_BARS=0`` to have them back.
- DeepSpeed's line about the accelerator it picked (``Setting ds_accelerator to cuda``), printed
  by every rank when DeepSpeed is imported: the device is the run's (``run.device``).
- Deprecation warnings (``DeprecationWarning``, ``FutureWarning``) on every rank but rank 0: every
  rank runs the same code, so rank 0 says each one once.
- Terminal colour codes in transformers' load report (``... LOAD REPORT``, e.g. the new score head
  of a reward model), written whatever the output is: kept only when stderr is a terminal, so a
  log file or a pipe reads plain text. The report itself is kept.

Nothing else is hidden: errors and other warnings reach the console as before.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import warnings

ACCELERATOR_LINES = ("Setting ds_accelerator to", "Setting accelerator to")
ANSI = re.compile(r"\x1b\[[0-9;]*m")
LOAD_REPORT_LOGGERS = ("transformers.modeling_utils", "transformers.modeling_layers", "transformers.integrations.peft")


class _AcceleratorChoice(logging.Filter):
    """Drops DeepSpeed's record of the accelerator it picked."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(ACCELERATOR_LINES)


class _PlainText(logging.Filter):
    """Strips terminal colour codes from a record unless stderr is a terminal."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not (sys.stderr is not None and sys.stderr.isatty()):
            record.msg, record.args = ANSI.sub("", record.getMessage()), None
        return True


def quiet_third_party(rank: int) -> None:
    """Silence the noise listed in the module docstring for this process (``rank``: its global
    rank). Call it before models load; calling it again changes nothing."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # read when huggingface_hub is imported
    if os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] not in ("0", "false", "False"):
        if "huggingface_hub" in sys.modules:  # already imported: its setting is made
            from huggingface_hub.utils import disable_progress_bars

            disable_progress_bars()
        if "transformers" in sys.modules:
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
    ds_logger = logging.getLogger("DeepSpeed")  # DeepSpeed's logger, made on its import: the filter stays on it
    if not any(isinstance(f, _AcceleratorChoice) for f in ds_logger.filters):
        ds_logger.addFilter(_AcceleratorChoice())
    for name in LOAD_REPORT_LOGGERS:  # the loggers that write the load report (made here if transformers is not imported yet)
        logger = logging.getLogger(name)
        if not any(isinstance(f, _PlainText) for f in logger.filters):
            logger.addFilter(_PlainText())
    if rank != 0:
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.filterwarnings("ignore", category=FutureWarning)
