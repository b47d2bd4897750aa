"""Joining or starting Ray: token authentication on either way (a local Ray gets a token of its own, a
joined cluster needs the user's, and RAY_AUTH_MODE=disabled is overridden), the local node on loopback,
and a Ray Client session whose server fails to start asked for again, a few times (other addresses and
other errors are not retried). A stand-in for the `ray` module records the calls."""

from __future__ import annotations

import logging
import os
import re
import stat
import sys
from pathlib import Path

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
        self.init_kwargs = kwargs
        self.auth_mode = os.environ.get("RAY_AUTH_MODE")  # what the processes Ray starts would inherit
        if self.failures:
            self.failures -= 1
            raise self.error("Initialization failure from server:\\nStarting Ray client server failed")

    def shutdown(self):
        self.shutdowns += 1


AUTH_ENV = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS",
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")


@pytest.fixture
def fake_ray(monkeypatch, tmp_path):
    """No Ray settings in the environment but a cluster token (restored afterwards), a home without
    ~/.ray, and Ray's own state (its cached mode and token, its node-IP constant) left alone."""
    monkeypatch.setattr(ray_runtime, "CLIENT_RETRY_S", 0.0)
    for name in AUTH_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RAY_AUTH_TOKEN", "a-cluster-token")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setattr(ray_runtime, "_reload_ray_auth", lambda: None)
    monkeypatch.setattr(ray_runtime, "_loopback_node", lambda: None)

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


def test_a_local_ray_has_a_fresh_token_of_its_own_that_only_this_user_can_read(fake_ray):
    ray = fake_ray(FakeRay(failures=0))
    assert ray_runtime.start_ray(None) is True
    assert ray.inits == ["local"] and ray.init_kwargs["include_dashboard"] is False
    assert ray.auth_mode == "token"
    assert "RAY_AUTH_TOKEN" not in os.environ  # it would win over the file
    token_file = Path(os.environ["RAY_AUTH_TOKEN_PATH"])
    assert re.fullmatch(r"[0-9a-f]{64}", token_file.read_text())
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(token_file.parent.stat().st_mode) == 0o700
    ray_runtime.start_ray(None)  # the next local Ray: another token
    assert Path(os.environ["RAY_AUTH_TOKEN_PATH"]).read_text() != token_file.read_text()


@pytest.mark.parametrize("address", [None, "127.0.0.1:6379"])
def test_ray_auth_mode_disabled_in_the_environment_is_overridden_with_a_warning(fake_ray, monkeypatch, caplog,
                                                                                address):
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    ray = fake_ray(FakeRay(failures=0))
    with caplog.at_level(logging.WARNING, logger=ray_runtime.__name__):
        ray_runtime.start_ray(address)
    assert ray.auth_mode == "token"
    assert "RAY_AUTH_MODE=disabled is ignored" in caplog.text


def test_joining_without_a_token_is_refused_in_one_line_before_ray_starts(fake_ray, monkeypatch):
    monkeypatch.delenv("RAY_AUTH_TOKEN")
    ray = fake_ray(FakeRay(failures=0))
    with pytest.raises(ValueError) as refused:
        ray_runtime.start_ray("10.0.0.5:6379")
    message = str(refused.value)
    assert "\n" not in message and "10.0.0.5:6379" in message
    assert all(source in message for source in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "~/.ray/auth_token"))
    assert ray.inits == []
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", "/nonexistent/token")  # a file named but not there
    with pytest.raises(ValueError, match="RAY_AUTH_TOKEN_PATH names /nonexistent/token"):
        ray_runtime.start_ray("10.0.0.5:6379")
    assert ray.inits == []


@pytest.mark.parametrize("source", ["RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "default file"])
def test_joining_takes_the_token_from_where_ray_looks(fake_ray, monkeypatch, tmp_path, source):
    monkeypatch.delenv("RAY_AUTH_TOKEN")
    if source == "RAY_AUTH_TOKEN":
        monkeypatch.setenv("RAY_AUTH_TOKEN", "a-cluster-token")
    elif source == "RAY_AUTH_TOKEN_PATH":
        (tmp_path / "token").write_text("a-cluster-token")
        monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "token"))
    else:
        (tmp_path / ".ray").mkdir()
        (tmp_path / ".ray" / "auth_token").write_text("a-cluster-token\n")
    ray = fake_ray(FakeRay(failures=0))
    assert ray_runtime.start_ray("ray://10.0.0.5:10001") is False
    assert ray.inits == ["ray://10.0.0.5:10001"] and ray.auth_mode == "token"


def test_the_local_node_is_on_loopback_even_when_ray_was_imported_first(monkeypatch):
    """Ray reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER at import; dflash serve imports ray before start_ray."""
    import ray
    from ray._private import ray_constants, services

    assert not ray.is_initialized()
    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", True)  # as if ray came before the setting
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "1")
    ray_runtime._loopback_node()
    assert services.get_node_ip_address() == "127.0.0.1"
    assert services.resolve_ip_for_localhost("127.0.0.1") == "127.0.0.1"
    assert os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"  # for the processes Ray starts
