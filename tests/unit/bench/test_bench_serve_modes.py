"""bench.bench_serve_modes on CPU with the demo pair: plain, dense and paged served over HTTP at
concurrency 1 and 2, and the requests admitted at equal memory, paged vs dense.

Oracles: every request of every mode and level counted with exactly the tokens asked for, and
acceptance only where there is a drafter; the admission sizes counted by hand from the demo configs
(bytes per token of each group, the dense reservation, the blocks left, dense's best max_num_seqs),
and the engine's running requests bounded by that count and by the prompts' blocks; the markdown
redrawn from the JSON alone equal to the one the run wrote; a spent budget skipping everything.
"""

import json

import pytest

from bench.bench_serve_modes import parse_args, run
from bench.bench_serve_modes_report import replot
from target_service.assembly.demo import demo_drafter_path, demo_target_path

LEVELS = [1, 2]
OUTPUT_LEN = 8
MEMORY_MIB = 32
LENGTHS = [4096, 1024]  # dense reserves max_model_len per slot: at 4096 it fits 2 slots, at 1024 eight
PROMPT_LEN, MAX_TOKENS, REQUESTS = 128, 16, 40


def flags(out, *extra: str) -> list[str]:
    return ["--device", "cpu", "--target", str(demo_target_path()), "--drafter", str(demo_drafter_path()),
            "--concurrency", *map(str, LEVELS), "--input-len", "24", "--output-len", str(OUTPUT_LEN),
            "--prompts-per-level", "1", "--min-prompts", "2", "--warmup-tokens", "2",
            "--max-model-len", "256", "--kv-cache-memory", "8MiB", "--admission-memory", f"{MEMORY_MIB}MiB",
            "--admission-max-model-len", *map(str, LENGTHS), "--admission-max-num-seqs", "64",
            "--admission-requests", str(REQUESTS), "--admission-prompt-len", str(PROMPT_LEN),
            "--admission-max-tokens", str(MAX_TOKENS), "--out", str(out), "--name", "modes", *extra]


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    out = tmp_path_factory.mktemp("serve_modes")
    run(parse_args(flags(out)))
    return json.loads((out / "modes.json").read_text()), out


def test_every_mode_serves_every_level_and_only_drafters_report_acceptance(measured):
    doc, out = measured
    modes = {m["mode"]: m for m in doc["serve"]["modes"]}
    assert sorted(modes) == ["dense", "paged", "plain"]
    for mode in modes.values():
        assert mode.get("error") is None and mode["skipped_levels"] == []
        assert [s["value"] for s in mode["settings"]] == LEVELS
        for setting in mode["settings"]:
            count = max(2, setting["value"])
            assert setting["requests"] == setting["completed"] == count and setting["failures"] == {}
            assert setting["output_tokens"] == count * OUTPUT_LEN and setting["output_throughput"] > 0
            assert setting["ttft_s"]["count"] == count  # the stand-in text streamed, so TTFT was seen
            drafts = setting["acceptance"]["drafts"]
            assert (drafts > 0) if mode["drafter"] else (drafts == 0)
        assert mode["num_speculative_tokens"] == (15 if mode["drafter"] else 0)
    assert modes["dense"]["dense_context_bytes"] > 0 == modes["paged"]["dense_context_bytes"]
    assert (out / "modes.png").stat().st_size > 0


def hand_count(max_model_len: int) -> dict:
    """The demo pair in float32 (the CPU engine's dtype): target 6 layers x 2 KV heads x 64, drafter
    3 layers x 2 x 64; 32 tokens per block; a request of 128 + 16 tokens holds 5 blocks."""
    target_bpt, draft_bpt, tpb = 2 * 6 * 2 * 64 * 4, 2 * 3 * 2 * 64 * 4, 32
    memory, per_request = MEMORY_MIB * 2**20, -(-(PROMPT_LEN + MAX_TOKENS) // tpb)
    paged_blocks = memory // (tpb * (target_bpt + draft_bpt))
    best = (0, 0, 0, 0)  # (requests, slots, reservation, blocks)
    for slots in range(1, 65):
        reservation = slots * (-(-max_model_len // tpb) * tpb) * draft_bpt
        blocks = max(0, (memory - reservation) // (tpb * target_bpt))
        runs = min(slots, blocks // per_request)
        if runs > best[0]:
            best = (runs, slots, reservation, blocks)
    return {"paged_blocks": paged_blocks, "paged_requests": paged_blocks // per_request,
            "dense_requests": best[0], "dense_slots": best[1], "dense_reservation": best[2],
            "dense_blocks": best[3]}


@pytest.mark.parametrize("max_model_len", LENGTHS)
def test_paged_admits_more_than_dense_at_equal_memory_as_counted_by_hand(measured, max_model_len):
    adm = measured[0]["admission"]
    expected = hand_count(max_model_len)
    paged = next(c for c in adm["cases"] if c["storage"] == "paged")
    dense = next(c for c in adm["cases"] if c["storage"] == "dense" and c["max_model_len"] == max_model_len)
    assert paged["pool_blocks"] == expected["paged_blocks"] and paged["dense_context_bytes"] == 0
    assert dense["max_num_seqs"] == expected["dense_slots"]
    assert dense["dense_context_bytes"] == expected["dense_reservation"]
    assert dense["pool_blocks"] == expected["dense_blocks"]
    plans = {(p["storage"], p["max_num_seqs"]): p for p in adm["plans"]
             if p["max_model_len"] == max_model_len}
    assert plans["paged", 64]["concurrent_requests"] == expected["paged_requests"]
    assert plans["dense", expected["dense_slots"]]["concurrent_requests"] == expected["dense_requests"]
    assert plans["dense", 64]["concurrent_requests"] == 0  # 64 slots x max_model_len: nothing left
    # the engine: dense fills its slots; paged holds at least the plan's count of full-length requests
    # and at most what the pool holds of their prompts alone
    running_paged = paged["first_finish"]["running"]
    assert dense["first_finish"]["running"] == dense["peak_running"] == expected["dense_requests"]
    assert expected["paged_requests"] <= running_paged <= expected["paged_blocks"] // (PROMPT_LEN // 32)
    assert running_paged > dense["first_finish"]["running"]
    assert paged["peak_used_blocks"] <= expected["paged_blocks"]


def test_the_markdown_is_redrawn_from_the_json_alone(measured):
    _, out = measured
    written = (out / "modes.md").read_text()
    (out / "modes.md").unlink()
    replot(out / "modes.json")
    assert (out / "modes.md").read_text() == written
    assert "| 4096 | dense | 2 | 42 | 24.00 MiB | 2 | 2 | 2 |" in written  # the hand count's row


def test_a_spent_budget_starts_nothing_and_says_so(tmp_path):
    doc = run(parse_args(flags(tmp_path, "--budget-s", "0")))
    assert doc["serve"]["skipped_modes"] == ["plain", "dense", "paged"] and doc["serve"]["modes"] == []
    assert doc["admission"]["cases"] == []
    assert sorted((s["storage"], s["max_model_len"]) for s in doc["admission"]["skipped"]) == [
        ("dense", 1024), ("dense", 4096), ("paged", 4096)]


def test_a_closed_replica_leaves_nothing_of_its_engine_in_memory():
    """FastAPI caches route functions for the life of the process; a slot that kept its server after
    the replica closed kept the engine, weights and pool too (on the H200: 54 GiB per mode)."""
    import gc
    import weakref

    import httpx

    from bench.serve_in_process import replica_server
    from target_service.serving.serve_args import ServeArgs

    args = ServeArgs(device="cpu", dtype="float32", kv_cache_memory="16MiB", max_model_len=512,
                     max_num_seqs=2, admin_port=None)
    with replica_server(args) as (url, replica):
        engine, model = weakref.ref(replica.assembly.engine), weakref.ref(replica.assembly.runner.target)
        reply = httpx.post(f"{url}/v1/completions", json={"prompt": "def f(x):", "max_tokens": 4}, timeout=60)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4
        del replica
    gc.collect()
    assert engine() is None and model() is None
