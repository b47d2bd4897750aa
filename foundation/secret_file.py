"""Secrets the services read at start-up (the pool's bearer token, the HTTP API key): from a file, else
from an environment variable, never from a command line where `ps` would show them."""

from __future__ import annotations

import os
from pathlib import Path

POOL_TOKEN_ENV = "DFLASH_KVPOOL_TOKEN"  # the pool's gRPC bearer token (admin calls, the control plane)
API_KEY_ENV = "DFLASH_API_KEY"  # the HTTP API's bearer key


def load_secret(secret_file: str | Path | None, *, env: str, what: str = "token") -> str | None:
    """The secret in `secret_file` (stripped), else the environment variable `env`; None: not set.

    what: how errors name the file ("token", "API key").
    """
    if secret_file is not None:
        try:
            secret = Path(secret_file).read_text().strip()
        except OSError as error:
            raise ValueError(f"cannot read the {what} file {secret_file}: {error.strerror}") from None
        if not secret:
            raise ValueError(f"the {what} file {secret_file} is empty")
        return secret
    return os.environ.get(env, "").strip() or None
