"""The memory plan: each phase's peak predicted before any model loads, from what each backend and
the engine say they keep, and the ``auto`` settings chosen to fit (docs/memory.md). The measured
peaks and parts of the device's memory are :mod:`tidal.logging.memory_peaks` and
:mod:`tidal.logging.memory_parts`."""
