"""The registry of the native engine's kernel backends (each backend module registers itself)."""

from tidal.registry import Registry

KERNELS: Registry = Registry("kernel backend")
