"""Benchmarks. ``bench.grpo`` is a package (``python -m bench.grpo e2e|matrix``); the other scripts
here run standalone (``python bench/rollout.py``)."""
