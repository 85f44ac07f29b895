"""Kernel backends of the native engine: the few fused ops a decoder step needs.

Every backend implements the same functions (see :class:`tidal.engine.native.kernels.torch_ops.TorchOps`
for the reference semantics): ``rms_norm``, ``silu_mul``, ``rope_store``, ``prefill_attention``,
``decode_attention``. ``torch`` runs anywhere (CPU tests, reference); ``triton`` is the CUDA fast path;
``exact`` is exact mode's (``numerics.exact``: batch-invariant, :mod:`tidal.exact`), chosen by the engine
itself, never by ``engine.kernel_backend``.
"""

from __future__ import annotations

import torch

from tidal.engine.native.kernels.registry import KERNELS


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def get_ops(name: str, device: torch.device):
    """The kernel backend ``name`` (``auto``: triton on CUDA when importable, else torch)."""
    from tidal.engine.native.kernels import torch_ops  # noqa: F401  (registers)

    if name == "auto":
        name = "triton" if device.type == "cuda" and triton_available() else "torch"
    if name == "triton":
        from tidal.engine.native.kernels import triton_ops  # noqa: F401  (registers)
    if name == "exact":
        from tidal.engine.native.kernels import exact_ops  # noqa: F401  (registers)
    return KERNELS.get(name, "kernel_backend")()
