"""A replica whose constructor raises: `dflash serve` says the replica's own error in one line, not
Serve's "Failed to update the deployments" (a -k the drafter's block refuses read that way before)."""

from __future__ import annotations

import random
from types import SimpleNamespace

from target_service.serving import deploy


def status_with(messages: dict[str, str]):
    deployments = {name: SimpleNamespace(message=message) for name, message in messages.items()}
    return SimpleNamespace(applications={deploy.APP_NAME: SimpleNamespace(deployments=deployments)})


def test_the_replicas_last_error_line_is_the_message(monkeypatch):
    limit = random.randint(3, 31)
    cause = f"ValueError: num_speculative_tokens {limit + 1} exceeds the drafter's block_size - 1 = {limit}"
    traceback = ("Traceback (most recent call last):\n  File \"replica.py\", line 1, in __init__\n"
                 f"    raise ValueError(...)\n{cause}\n\n")
    monkeypatch.setattr(deploy.serve, "status", lambda: status_with({deploy.DEPLOYMENT_NAME: traceback}))
    serve_error = RuntimeError("Deploying application dflash failed: Failed to update the deployments")
    assert deploy.replica_failure(serve_error) == f"a replica failed to start: {cause}"


def test_without_the_replicas_words_serves_own_error_is_kept(monkeypatch):
    serve_error = RuntimeError(f"Deploying application dflash failed: {random.random()}")
    monkeypatch.setattr(deploy.serve, "status", lambda: status_with({deploy.DEPLOYMENT_NAME: ""}))
    assert deploy.replica_failure(serve_error) == f"a replica failed to start: {serve_error}"

    def ray_is_gone():
        raise ConnectionError("the GCS went away")

    monkeypatch.setattr(deploy.serve, "status", ray_is_gone)
    assert deploy.replica_failure(serve_error) == f"a replica failed to start: {serve_error}"
