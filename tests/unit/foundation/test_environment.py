"""Settings from the environment: unset or empty is the default, an allowed value is taken, anything
else is one error naming the variable."""

from __future__ import annotations

import random

import pytest

from foundation.environment import env_number, env_switch

NAME = "DFLASH_TEST_SETTING"


def test_a_switch_is_0_or_1_and_nothing_else(monkeypatch):
    default = random.choice([True, False])
    monkeypatch.delenv(NAME, raising=False)
    assert env_switch(NAME, default) is default
    for text, value in (("0", False), ("1", True), (" 1 ", True), ("", default)):
        monkeypatch.setenv(NAME, text)
        assert env_switch(NAME, default) is value
    for bad in ("false", "yes", "2", "off"):
        monkeypatch.setenv(NAME, bad)
        with pytest.raises(ValueError) as raised:
            env_switch(NAME)
        assert str(raised.value) == f"{NAME} must be 0 or 1, got {bad!r}"


def test_a_number_is_finite_and_not_negative(monkeypatch):
    value = random.uniform(0, 1000)
    monkeypatch.setenv(NAME, repr(value))
    assert env_number(NAME, 7.0) == value
    monkeypatch.setenv(NAME, "")
    assert env_number(NAME, 7.0) == 7.0
    for bad in ("fast", "-1", "nan", "inf"):
        monkeypatch.setenv(NAME, bad)
        with pytest.raises(ValueError) as raised:
            env_number(NAME, 7.0)
        assert str(raised.value) == f"{NAME} must be a number >= 0, got {bad!r}"
