"""Running moments and batch whitening, locally and all-reduced over two gloo ranks."""

import math
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tidal.algorithms.normalization import RunningMoments, masked_whiten


def test_running_moments_match_the_concatenation():
    xs = [torch.tensor([1.0, 4.0]), torch.tensor([2.0]), torch.tensor([7.0, -1.0, 3.0])]
    rm = RunningMoments()
    for x in xs:
        rm.update(x)
    flat = torch.cat(xs).double()
    assert rm.count == 6 and rm.mean == pytest.approx(flat.mean().item())
    assert rm.var == pytest.approx(flat.var(unbiased=False).item())


def test_running_moments_respect_mask():
    rm = RunningMoments()
    rm.update(torch.tensor([[1.0, 100.0], [3.0, 100.0]]), torch.tensor([[1.0, 0.0], [1.0, 0.0]]))
    assert (rm.count, rm.mean, rm.var) == (2.0, 2.0, 1.0)
    assert rm.normalize(torch.tensor([4.0])).item() == pytest.approx(2.0, rel=1e-6)
    assert rm.normalize(torch.tensor([4.0]), center=False).item() == pytest.approx(4.0, rel=1e-6)


def test_masked_whiten_by_hand():
    x = torch.tensor([[1.0, 2.0, 50.0], [3.0, 50.0, 50.0]])
    m = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    s = math.sqrt(2 / 3 + 1e-8)
    assert torch.allclose(masked_whiten(x, m), torch.tensor([[-1 / s, 0.0, 0.0], [1 / s, 0.0, 0.0]]), atol=1e-6)


def _worker(rank, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    x = [torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0, 9.0]])][rank]
    m = [torch.tensor([[1.0, 1.0]]), torch.tensor([[1.0, 0.0]])][rank]
    w = masked_whiten(x, m, group=dist.group.WORLD)
    rm = RunningMoments()
    rm.update(x, m, group=dist.group.WORLD)
    torch.save((w.tolist(), rm.mean, rm.var), os.path.join(out_dir, f"{rank}.pt"))
    dist.destroy_process_group()


def test_statistics_are_global_over_the_group(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(port, str(tmp_path)), nprocs=2, join=True)
    out = [torch.load(tmp_path / f"{r}.pt") for r in range(2)]
    s = math.sqrt(2 / 3 + 1e-8)  # global masked values [1, 2, 3]: mean 2, var 2/3
    assert out[0][0][0] == pytest.approx([-1 / s, 0.0], abs=1e-6)
    assert out[1][0][0] == pytest.approx([1 / s, 0.0], abs=1e-6)
    assert out[0][1] == out[1][1] == pytest.approx(2.0) and out[0][2] == pytest.approx(2 / 3)
