"""Queued host <-> device transfers: the values arrive intact, whatever is queued around them."""

import pytest
import torch

from foundation.host_transfer import HostReadback, to_device


def devices():
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", devices())
def test_to_device_and_back(device):
    values = torch.randint(-2**40, 2**40, (37,)).tolist()
    on_device = to_device(values, torch.int64, device)
    assert on_device.device.type == device and on_device.dtype == torch.int64
    assert HostReadback(on_device).tolist() == values
    table = torch.randint(0, 1000, (3, 5)).tolist()
    assert HostReadback(to_device(table, torch.int32, device)).tolist() == table


@pytest.mark.parametrize("device", devices())
def test_readback_sees_the_values_at_its_copy_not_later_writes(device):
    """The copy is queued where it is started: work queued after it (a long GEMM, then an overwrite)
    does not reach what the host reads, and the host reads only after the copy landed."""
    values = torch.randint(0, 100, (1000,), device=device)
    expected = values.tolist()
    busy = torch.randn(2048, 2048, device=device)
    readback = HostReadback(values)
    for _ in range(4):
        busy = busy @ busy / 64
    values.fill_(-1)
    assert readback.tolist() == expected
