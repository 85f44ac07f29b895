"""Tidal's native rollout engine: paged KV cache, continuous batching, prefix sharing, CUDA graphs."""

from tidal.engine.native.engine import NativeEngine

__all__ = ["NativeEngine"]
