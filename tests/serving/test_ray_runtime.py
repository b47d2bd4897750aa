"""Joining Ray: a Ray Client session whose server fails to start is asked for again, a few times;
other addresses and other errors are not retried. A stand-in for the `ray` module records the calls."""

from __future__ import annotations

import sys

import pytest

from target_service.assembly import ray_runtime


class FakeRay:
    def __init__(self, failures: int, error=ConnectionAbortedError):
        self.failures, self.error = failures, error
        self.inits, self.shutdowns = [], 0

    def is_initialized(self) -> bool:
        return False

    def init(self, **kwargs):
        self.inits.append(kwargs["address"])
        if self.failures:
            self.failures -= 1
            raise self.error("Initialization failure from server:\\nStarting Ray client server failed")

    def shutdown(self):
        self.shutdowns += 1


@pytest.fixture
def fake_ray(monkeypatch):
    monkeypatch.setattr(ray_runtime, "CLIENT_RETRY_S", 0.0)

    def install(fake):
        monkeypatch.setitem(sys.modules, "ray", fake)
        return fake

    return install


def test_a_ray_client_session_that_fails_to_start_is_asked_for_again(fake_ray):
    ray = fake_ray(FakeRay(failures=ray_runtime.CLIENT_CONNECT_ATTEMPTS - 1))
    assert ray_runtime.start_ray("ray://127.0.0.1:10001") is False  # joined, not started
    assert ray.inits == ["ray://127.0.0.1:10001"] * ray_runtime.CLIENT_CONNECT_ATTEMPTS
    assert ray.shutdowns == ray_runtime.CLIENT_CONNECT_ATTEMPTS - 1


def test_the_error_stands_after_the_last_attempt_and_only_client_addresses_retry(fake_ray):
    ray = fake_ray(FakeRay(failures=ray_runtime.CLIENT_CONNECT_ATTEMPTS))
    with pytest.raises(ConnectionAbortedError, match="Initialization failure"):
        ray_runtime.start_ray("ray://127.0.0.1:10001")
    assert len(ray.inits) == ray_runtime.CLIENT_CONNECT_ATTEMPTS
    gcs = fake_ray(FakeRay(failures=1))
    with pytest.raises(ConnectionAbortedError):
        ray_runtime.start_ray("127.0.0.1:6379")  # a GCS address: no client session to ask again
    assert gcs.inits == ["127.0.0.1:6379"]
    other = fake_ray(FakeRay(failures=1, error=ValueError))
    with pytest.raises(ValueError):
        ray_runtime.start_ray("ray://127.0.0.1:10001")
    assert len(other.inits) == 1
