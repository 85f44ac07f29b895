"""Device-memory accounting on CPU, for tests of memory predictions.

:class:`LiveBytes` is a dispatch mode that sees every tensor an operator returns: it counts the
bytes of each new storage from its creation until it is freed (checked after every operator, through
weak references) and keeps the peak. Outputs over an input's storage (views, in-place
results) are not new memory; storages listed in ``ignore`` or inside ``ignore_range`` (parameters,
host buffers) are not counted. Memory a kernel allocates for itself and frees before
returning is not seen; on CPU the kernels here allocate nothing of the sort that matters.
"""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    def __init__(self, ignore=(), ignore_range: tuple[int, int] | None = None):
        super().__init__()
        self.ignore = {int(p) for p in ignore}
        self.ignore_range = ignore_range  # [start, end) of addresses not counted (e.g. a host buffer)
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.current = self.peak = 0

    def _counted(self, st: torch.UntypedStorage) -> bool:
        ptr = st.data_ptr()
        if st.nbytes() == 0 or ptr in self.ignore:
            return False
        return not (self.ignore_range and self.ignore_range[0] <= ptr < self.ignore_range[1])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # an output over an input's storage (a view, an in-place result) is no new memory
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and not t.is_meta}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and not t.is_meta:
                st = t.untyped_storage()
                if st._cdata not in self.live and st.data_ptr() not in inputs and self._counted(st):
                    self.live[st._cdata] = (StorageWeakRef(st), st.nbytes())
                    self.current += st.nbytes()
        self.peak = max(self.peak, self.current)
        self._sweep()
        return out

    def _sweep(self) -> None:
        for key in [k for k, (ref, _) in self.live.items() if ref.expired()]:
            self.current -= self.live.pop(key)[1]

    def __exit__(self, *exc):
        self._sweep()  # what was freed after the last operator
        return super().__exit__(*exc)

    def reset_peak(self) -> None:
        self.peak = self.current


def allocation_peak(fn) -> tuple[int, int]:
    """(peak, net): the most CPU bytes allocated above the start while ``fn()`` runs, and what is
    still allocated at its end, from the profiler's record of every allocation and free (all of
    them: also those inside kernels, collectives and FSDP2's resized storages, which
    :class:`LiveBytes` does not see)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"), key=lambda e: e.start_ns())
    current = peak = 0
    for e in events:
        current += e.nbytes()
        peak = max(peak, current)
    return peak, current
