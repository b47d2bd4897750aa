"""The secret-file reader: a file first, then the environment; one-line errors naming the file."""

import pytest

from foundation.secret_file import POOL_TOKEN_ENV, load_secret


def test_secret_comes_from_the_file_then_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(POOL_TOKEN_ENV, raising=False)
    assert load_secret(None, env=POOL_TOKEN_ENV) is None
    monkeypatch.setenv(POOL_TOKEN_ENV, " from-env\n")
    assert load_secret(None, env=POOL_TOKEN_ENV) == "from-env"
    path = tmp_path / "token"
    path.write_text("from-file\n")
    assert load_secret(path, env=POOL_TOKEN_ENV) == "from-file"
    path.write_text("  \n")
    with pytest.raises(ValueError, match=r"the token file .* is empty"):
        load_secret(path, env=POOL_TOKEN_ENV)
    with pytest.raises(ValueError, match="cannot read the API key file"):
        load_secret(tmp_path / "missing", env=POOL_TOKEN_ENV, what="API key")
