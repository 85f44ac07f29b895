"""The memory plan: each phase's peak predicted before any model loads, the ``auto`` settings chosen
to fit, and the measured parts of the device's memory (docs/memory.md)."""
