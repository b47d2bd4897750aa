"""The engines the server drives (and the meter it drives them through) hold to `EngineClient` member
by member: the same properties, the same call signatures (names, kinds, defaults), `generate` an async
generator in each. The protocol's `isinstance` check looks at names only; this compares what a caller
would bind against."""

from __future__ import annotations

import inspect

import pytest

from target_service.assembly.remote_engine import RemoteEngine
from target_service.engine.async_engine import AsyncEngine
from target_service.engine.engine_client import EngineClient
from target_service.serving.metered_engine import MeteredEngine

ENGINES = [AsyncEngine, RemoteEngine, MeteredEngine]


def protocol_members() -> dict[str, object]:
    return {name: member for name, member in vars(EngineClient).items()
            if not name.startswith("_") and (callable(member) or isinstance(member, property))}


def shape(member) -> tuple:
    """What a caller binds against: a property, or the parameters (without self) and async-ness."""
    if isinstance(member, property):
        return ("property",)
    parameters = [(p.name, p.kind, p.default) for p in inspect.signature(member).parameters.values()][1:]
    is_async = inspect.isasyncgenfunction(member) or inspect.iscoroutinefunction(member)
    return ("method", tuple(parameters), is_async)


def test_the_protocol_names_what_the_server_asks():
    assert set(protocol_members()) == {"is_healthy", "num_running", "num_waiting", "check", "snapshot",
                                       "generate", "shutdown"}


@pytest.mark.parametrize("engine", ENGINES, ids=lambda cls: cls.__name__)
def test_each_engine_has_every_member_of_the_protocol_in_its_shape(engine):
    for name, member in protocol_members().items():
        assert hasattr(engine, name), f"{engine.__name__} lacks {name}"
        if name == "generate":  # the protocol states the iterator; both engines are async generators
            assert inspect.isasyncgenfunction(getattr(engine, name)), f"{engine.__name__}.generate"
            assert shape(getattr(engine, name))[1] == shape(member)[1]
            continue
        assert shape(vars(engine)[name]) == shape(member), f"{engine.__name__}.{name}"


@pytest.mark.parametrize("engine", [AsyncEngine, RemoteEngine], ids=lambda cls: cls.__name__)
def test_each_engine_says_whether_its_check_waits_on_another_process(engine):
    assert set(EngineClient.__annotations__) == {"check_blocks"}
    assert engine.check_blocks is (engine is RemoteEngine)


def test_a_member_of_another_shape_is_caught():
    class Drifted:
        def check(self, prompt_token_ids, params, strict=True): ...

    assert shape(Drifted.check) != shape(protocol_members()["check"])
