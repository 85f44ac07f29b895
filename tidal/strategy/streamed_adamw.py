"""AdamW whose moments live in host memory and stream through the device during the step.

``strategy.offload_optimizer`` with FSDP2. The two fp32 moments of every parameter (of this rank's
shard: FSDP2's DTensor parameters are updated through their local tensors) sit in one
:class:`~tidal.host_memory.PinnedBuffer` of exactly their size, allocated at the first step (or the
first checkpoint load). :meth:`StreamedAdamW.step` walks the parameters in chunks of at most
``chunk_bytes`` of moments (a large parameter is split: AdamW is elementwise): a chunk's moments
are copied to a device staging buffer, updated together with its parameters by torch's own AdamW
kernel (``torch.optim.adamw.adamw``: fused on CUDA, foreach elsewhere, the same math and
implementation as ``torch.optim.AdamW`` with that flag), and copied back. On CUDA two staging
buffers alternate and the copies run on their own streams: the next chunk comes in and the last
one goes out while a chunk is updated. The device holds two chunks (``2 * chunk_bytes``), never
the whole state, and nothing between steps.

Why not a library: torchao's ``CPUOffloadOptimizer`` runs the step on the CPU for single-GPU
training (no DTensor parameters, grads copied to the host by hooks before clipping), and its
``state_dict`` is not the torch layout that DCP's ``get_state_dict`` maps to parameter names; an
8-bit AdamW changes the numerics. This one is exactly AdamW, and checkpoints like it.

State layout is torch AdamW's: per parameter ``step`` (a CPU float32 scalar), ``exp_avg`` and
``exp_avg_sq`` (DTensors with the parameter's placements for DTensor parameters, whose local tensors
are views of the host buffer). So ``state_dict()`` is what ``torch.optim.AdamW`` would give (DCP
saves the host tensors, and loads into them in place), and a checkpoint of either optimizer loads
into the other.

Not supported (errors): ``amsgrad``, ``maximize``, a non-contiguous parameter or gradient.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable

import torch
from torch.distributed.tensor import DTensor
from torch.optim.adamw import adamw as adamw_functional

from tidal.host_memory import PinnedBuffer

DEFAULT_CHUNK_BYTES = 256 << 20


def _local(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor holding a (DTensor) parameter's or gradient's values on this rank."""
    return t._local_tensor if isinstance(t, DTensor) else t


def _flat(t: torch.Tensor, what: str) -> torch.Tensor:
    t = _local(t)
    if not t.is_contiguous():
        raise ValueError(f"StreamedAdamW needs contiguous {what}s (got strides {t.stride()} for shape {tuple(t.shape)})")
    return t.view(-1)


class StreamedAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) with its moments in host memory, streamed through ``device``
    in chunks of at most ``chunk_bytes`` (both moments) per step. ``params``: tensors or groups
    (per-group ``lr``, ``betas``, ``eps``, ``weight_decay``), on ``device``."""

    def __init__(
        self, params: Iterable, *, device: torch.device | str, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8, weight_decay: float = 0.01, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ):
        if chunk_bytes < 8:
            raise ValueError("chunk_bytes must hold at least one element's two moments (8 bytes)")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.device = torch.device(device)
        self.chunk_elems = chunk_bytes // 8
        self._host: PinnedBuffer | None = None
        self._offsets: dict[torch.Tensor, int] = {}  # parameter -> element offset of its exp_avg in the buffer
        self._chunks: list[tuple[int, list[tuple[torch.Tensor, int, int]]]] = []
        self._streams: tuple[torch.cuda.Stream, torch.cuda.Stream] | None = None
        self.peak_staging_bytes = 0  # device bytes of the staging buffers of the last step

    # ---- host state ------------------------------------------------------------------------------
    @property
    def host_bytes(self) -> int:
        """Bytes of host memory the moments take (0 before the first step)."""
        return self._host.nbytes if self._host is not None else 0

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def _ensure_state(self) -> None:
        """Allocate the host buffer (zeros: AdamW's initial moments) and the state entries, once."""
        if self._host is not None:
            return
        total = 0
        for p in self._params():
            if p.dtype != torch.float32:
                raise ValueError(f"StreamedAdamW updates fp32 parameters (master weights); got {p.dtype}")
            self._offsets[p] = total
            total += 2 * _local(p).numel()
        self._host = PinnedBuffer(4 * total, pin=self.device.type == "cuda", zero=True)
        for p in self._params():
            st = self.state[p]
            st.setdefault("step", torch.tensor(0.0, dtype=torch.float32))
            st["exp_avg"], st["exp_avg_sq"] = self._state_tensors(p)
        self._chunks = self._plan_chunks()

    def _host_moments(self, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat fp32 host views of ``p``'s exp_avg and exp_avg_sq."""
        n, off = _local(p).numel(), self._offsets[p]
        return (self._host.view(4 * off, (n,), torch.float32), self._host.view(4 * (off + n), (n,), torch.float32))

    def _state_tensors(self, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The moments as ``state`` holds them: shaped like the parameter (a DTensor with its
        placements for a DTensor parameter) over the host buffer itself. Not
        ``DTensor.from_local``: it moves a local tensor to its mesh's device type, which would put
        a stale copy of both moments on the GPU (the whole state the streaming exists to keep off
        it) and hand checkpoints that copy instead of the moments the steps update."""
        out = []
        for flat in self._host_moments(p):
            local = flat.view(_local(p).shape)
            if isinstance(p, DTensor):  # the parameter's spec: same mesh, placements, shape, stride, fp32
                local = DTensor(local, p._spec, requires_grad=False)
            out.append(local)
        return out[0], out[1]

    def _plan_chunks(self) -> list[tuple[int, list[tuple[torch.Tensor, int, int]]]]:
        """(group index, [(param, start, end) element ranges]) with at most ``chunk_elems`` elements
        each, in parameter order; a chunk never spans two groups."""
        chunks = []
        for gi, group in enumerate(self.param_groups):
            segs, size = [], 0
            for p in group["params"]:
                n, start = _local(p).numel(), 0
                while start < n:
                    take = min(n - start, self.chunk_elems - size)
                    segs.append((p, start, start + take))
                    size += take
                    start += take
                    if size == self.chunk_elems:
                        chunks.append((gi, segs))
                        segs, size = [], 0
            if segs:
                chunks.append((gi, segs))
        return chunks

    # ---- the step ---------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._ensure_state()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.state[p]["step"] += 1
        work = [(gi, [s for s in segs if s[0].grad is not None]) for gi, segs in self._chunks]
        self._stream([(gi, segs) for gi, segs in work if segs])
        return loss

    def _stream(self, work: list[tuple[int, list[tuple[torch.Tensor, int, int]]]]) -> None:
        """Copy in, update, copy out, chunk by chunk through two staging buffers."""
        if not work:
            return
        cuda = self.device.type == "cuda"
        longest = max(sum(e - s for _, s, e in segs) for _, segs in work)
        stages = [torch.empty(2 * longest, dtype=torch.float32, device=self.device) for _ in range(min(2, len(work)))]
        self.peak_staging_bytes = sum(s.numel() * 4 for s in stages)
        h2d, d2h = self._copy_streams() if cuda else (None, None)
        compute = torch.cuda.current_stream(self.device) if cuda else None
        if cuda:  # the staging memory may have been freed by kernels still queued on the compute stream
            h2d.wait_stream(compute)
        stage_free: list[Any] = [None] * len(stages)  # event: the last copy out of that stage is done
        for i, (gi, segs) in enumerate(work):
            k = i % len(stages)
            n = sum(e - s for _, s, e in segs)
            m_N, v_N = stages[k][:n], stages[k][n : 2 * n]
            with torch.cuda.stream(h2d) if cuda else contextlib.nullcontext():
                if stage_free[k] is not None:
                    h2d.wait_event(stage_free[k])
                self._copy(segs, m_N, v_N, to_host=False)
                loaded = h2d.record_event() if cuda else None
            if cuda:
                compute.wait_event(loaded)
            self._update(self.param_groups[gi], segs, m_N, v_N)
            with torch.cuda.stream(d2h) if cuda else contextlib.nullcontext():
                if cuda:
                    d2h.wait_event(compute.record_event())
                self._copy(segs, m_N, v_N, to_host=True)
                stage_free[k] = d2h.record_event() if cuda else None
        if cuda:
            # the host moments are complete (a checkpoint may read them) and every use of the staging
            # buffers (copies on the side streams, updates on the compute stream) is finished
            d2h.synchronize()
        del stages

    def _copy_streams(self) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
        if self._streams is None:
            self._streams = (torch.cuda.Stream(self.device), torch.cuda.Stream(self.device))
        return self._streams

    def _copy(self, segs, m_N: torch.Tensor, v_N: torch.Tensor, *, to_host: bool) -> None:
        off = 0
        for p, s, e in segs:
            n = e - s
            host_m, host_v = self._host_moments(p)
            for host, dev in ((host_m[s:e], m_N[off : off + n]), (host_v[s:e], v_N[off : off + n])):
                (host.copy_(dev, non_blocking=True) if to_host else dev.copy_(host, non_blocking=True))
            off += n

    def _update(self, group: dict, segs, m_N: torch.Tensor, v_N: torch.Tensor) -> None:
        """torch's AdamW on this chunk's parameter and gradient slices and staged moments."""
        params, grads, exp_avgs, exp_avg_sqs, steps, off = [], [], [], [], [], 0
        for p, s, e in segs:
            n = e - s
            params.append(_flat(p, "parameter")[s:e])
            grads.append(_flat(p.grad, "gradient")[s:e])
            exp_avgs.append(m_N[off : off + n])
            exp_avg_sqs.append(v_N[off : off + n])
            steps.append(float(self.state[p]["step"]) - 1)  # the functional counts the step itself
            off += n
        cuda = self.device.type == "cuda"
        # one fresh step tensor per slice: the functional increments each (a parameter split over
        # chunks must not be counted twice)
        steps_S = torch.tensor(steps, dtype=torch.float32)
        if cuda:  # from pinned memory: no wait for the device
            steps_S = steps_S.pin_memory().to(self.device, non_blocking=True)
        step_tensors = list(steps_S.unbind())
        beta1, beta2 = group["betas"]
        adamw_functional(
            params, grads, exp_avgs, exp_avg_sqs, [], step_tensors, foreach=not cuda, fused=cuda or None,
            amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
            maximize=False,
        )

    # ---- checkpoints -----------------------------------------------------------------------------
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of this optimizer or of ``torch.optim.AdamW`` (the same layout): the
        moments are copied into the host buffer (never staged on the device), the rest is
        torch's ``Optimizer.load_state_dict``."""
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = self._params()
        if len(saved_ids) != len(params):
            raise ValueError(f"optimizer state for {len(saved_ids)} parameters, this optimizer has {len(params)}")
        moments, rest = {}, {}
        for k, st in state_dict["state"].items():
            st = dict(st)
            moments[k] = (st.pop("exp_avg", None), st.pop("exp_avg_sq", None))
            rest[k] = st
        super().load_state_dict({**state_dict, "state": rest})
        self._ensure_state()
        loaded = dict(zip(params, saved_ids))
        for p in params:
            m, v = moments.get(loaded[p], (None, None))
            if (m is None) != (v is None):
                raise ValueError(f"optimizer state of parameter {loaded[p]!r} has only one of AdamW's moments")
            for host, value in zip(self._host_moments(p), (m, v)):
                if value is None:  # a parameter never stepped: AdamW's initial (zero) moments
                    host.zero_()
                    continue
                value = _local(value).reshape(-1)
                if value.numel() != host.numel():
                    raise ValueError(f"optimizer state of parameter {loaded[p]!r} has {value.numel()} elements on this rank, expected {host.numel()}")
                if value.data_ptr() != host.data_ptr():  # DCP loads in place: then it is there already
                    host.copy_(value)
            st = self.state[p]
            st["step"] = torch.as_tensor(st.get("step", 0.0), dtype=torch.float32).detach().to("cpu").reshape(()).clone()
            st["exp_avg"], st["exp_avg_sq"] = self._state_tensors(p)
