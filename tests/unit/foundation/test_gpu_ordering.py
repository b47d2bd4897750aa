"""The choice of the step channel's GPU ordering: names checked in one line, the environment's
override read only for "auto", and each mechanism refusing a device that is not CUDA.

(On a GPU both mechanisms order real work: tests/multiprocess/test_step_channel_gpu_ordering.py.)
"""

import pytest
import torch

from foundation.gpu_ordering import attach_ordering, create_ordering

CPU = torch.device("cpu")


def test_a_bad_override_in_the_environment_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("DFLASH_CHANNEL_ORDERING", "semaphores")
    with pytest.raises(ValueError, match=r"^DFLASH_CHANNEL_ORDERING must be one of .* got 'semaphores'$"):
        create_ordering(CPU, "auto")


@pytest.mark.parametrize("ordering, what", [("flags", "stream flags"), ("events", "CUDA IPC events")])
def test_an_explicit_ordering_ignores_the_environment_and_wants_a_cuda_device(monkeypatch, ordering, what):
    monkeypatch.setenv("DFLASH_CHANNEL_ORDERING", "semaphores")  # not read: the caller chose
    with pytest.raises(ValueError, match=f"^{what} live on a CUDA device, got 'cpu'$"):
        create_ordering(CPU, ordering)


def test_the_environment_picks_the_mechanism_for_auto(monkeypatch):
    monkeypatch.setenv("DFLASH_CHANNEL_ORDERING", "events")
    with pytest.raises(ValueError, match=r"^CUDA IPC events live on a CUDA device"):
        create_ordering(CPU, "auto")


def test_an_unknown_ordering_is_refused_and_no_handle_attaches_nothing():
    with pytest.raises(ValueError, match=r"^ordering must be one of .* got 'fences'$"):
        create_ordering(CPU, "fences")
    assert attach_ordering(None) is None
