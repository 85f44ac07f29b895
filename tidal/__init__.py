"""Tidal: colocated reinforcement fine-tuning of language models on torchrun.

Importing Tidal makes torch's OpenMP threads sleep, not spin, while they wait (``OMP_WAIT_POLICY``
``PASSIVE`` unless the environment sets it): libgomp reads the variable once, when torch loads, and
by default a waiting thread spins on its core. On a machine whose other processes hold every core
the spinning threads take turns with them, and the SFT warm start with 2 threads ran 0.8 steps/s
against 4.3 passive and 5.4 with 1 thread (``bench/busy_threads.py``; docs/quickstart.md#cpu-threads).
It has no effect when torch was imported first.

Importing Tidal also keeps ``transformers`` (5.x) from fetching kernels from the Hugging Face Hub
(``USE_HUB_KERNELS=NO`` unless the environment sets it): Tidal downloads nothing at run time, and on
a machine without network ``transformers`` would otherwise try the Hub for a model's kernels when
it loads or switches train/eval mode. Set ``USE_HUB_KERNELS=YES`` to let it.
"""

import os as _os

_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
_os.environ.setdefault("USE_HUB_KERNELS", "NO")

__version__ = "0.1.0"
