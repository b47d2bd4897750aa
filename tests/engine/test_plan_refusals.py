"""One start-up plan, one set of refusals: each setting the plan refuses is refused the same way by
`LLM(services="inprocess")` and `LLM(services="ray")`, with the same one-line error, and the Ray
path refuses before it starts Ray or any actor (its plan is resolved from configs alone)."""

from __future__ import annotations

import json

import pytest
from engine_helpers import make_pair

from target_service.llm import LLM

SETTINGS = dict(device="cpu", dtype="float32", kv_cache_memory="2MiB", tokens_per_block=16, max_num_seqs=4)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("pair"), block_size=8)


def refusals(target) -> list[tuple[dict, bool, str]]:
    """(settings, with a drafter, the error's pattern) of every refusal the plan makes."""
    positions = json.loads((target / "config.json").read_text())["max_position_embeddings"]
    return [
        (dict(device="cuda:99"), True, r"device 'cuda:99' was asked for but "),
        (dict(device="tpu"), True, r"^device: must be cpu, cuda or cuda:N, got 'tpu'$"),
        (dict(max_model_len=positions + 1), True,
         rf"max_model_len {positions + 1} exceeds the target's max_position_embeddings {positions}"),
        (dict(num_speculative_tokens=8), True,
         r"num_speculative_tokens 8 exceeds the drafter's block_size - 1 = 7"),
        (dict(num_speculative_tokens=3), False, r"num_speculative_tokens needs a drafter"),
        (dict(tokens_per_block=12), True, r"^tokens_per_block: .*power of two >= 16, got 12$"),
    ]


@pytest.fixture
def ray_must_not_start(monkeypatch):
    """Any start of Ray fails the test: the refusal has to come first."""
    import ray

    import target_service.assembly.ray_services as ray_services

    def started(*args, **kwargs):
        raise AssertionError("Ray was started before the plan refused")

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray_services, "start_ray", started)


@pytest.mark.parametrize("case", range(6))
@pytest.mark.parametrize("services", ["inprocess", "ray"])
def test_each_assembly_refuses_what_the_plan_refuses(pair, case, services, request):
    target, drafter = pair
    settings, with_drafter, pattern = refusals(target)[case]
    if services == "ray":
        request.getfixturevalue("ray_must_not_start")
    with pytest.raises(ValueError, match=pattern) as refused:
        LLM(str(target), str(drafter) if with_drafter else None, services=services,
            **{**SETTINGS, **settings})
    assert "\n" not in str(refused.value)  # one line


def test_both_assemblies_word_a_refusal_alike(pair, request):
    target, drafter = pair
    request.getfixturevalue("ray_must_not_start")
    messages = []
    for services in ("inprocess", "ray"):
        with pytest.raises(ValueError) as refused:
            LLM(str(target), str(drafter), services=services, **{**SETTINGS, "num_speculative_tokens": 9})
        messages.append(str(refused.value))
    assert messages[0] == messages[1]
