"""The replica's metrics against a real engine run, with hand-computed values: vLLM's series (names,
types, labels, meanings) move as the requests ran, the engine's counters and tokens per step agree with
what was sent, the request phases add up (queue + prefill = TTFT, prefill + decode = inference, the
inter-token gaps sum to the decode time), the prefix-cache counters count the hit a repeated prompt
gets, and a cancelled request is an abort. Random pairs, prompts and lengths each run."""

import asyncio
import random

import pytest
from engine_helpers import make_pair, random_prompts
from prometheus_client.parser import text_string_to_metric_families
from promtool import check_metrics

from target_service.engine.async_engine import AsyncEngine
from target_service.engine.sampling_params import SamplingParams
from target_service.llm import LLM
from target_service.serving.metered_engine import MeteredEngine
from target_service.serving.metrics import (
    REQUEST_LATENCY_BUCKETS,
    TOKEN_LATENCY_BUCKETS,
    TTFT_BUCKETS,
    ServerMetrics,
    merge,
    one_two_five,
    render,
)

LABELS = {"model_name": "demo", "engine": "3", "replica": "3"}
K, MAX_MODEL_LEN, TOKENS_PER_BLOCK = 3, 128, 16


class RecordingMetrics(ServerMetrics):
    """ServerMetrics that also keeps each finished request's times: the hand computation's inputs."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.requests = []

    def finished(self, times, finish_reason, now):
        self.requests.append((times, finish_reason, now))
        super().finished(times, finish_reason, now)


def served(llm: LLM, **options):
    """(AsyncEngine, metrics, MeteredEngine) over the LLM's engine, wired as a replica does."""
    engine = AsyncEngine(llm.engine)
    metrics = RecordingMetrics(engine, llm.engine.counters, model_name="demo", replica="3",
                               groups=["target", "draft"], max_model_len=MAX_MODEL_LEN,
                               num_speculative_tokens=K, **options)
    meter = MeteredEngine(engine, metrics)
    llm.engine.on_scheduled = meter.scheduled
    return engine, metrics, meter


def samples(text: str) -> dict:
    """(sample name, frozen labels) -> value, parsed back from the exposition text."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return out


def value(table, name, **labels):
    return table[(name, frozenset({**LABELS, **labels}.items()))]


def buckets_of(table, name) -> dict[float, float]:
    return {float(dict(labels)["le"]): v for (sample, labels), v in table.items()
            if sample == f"{name}_bucket" and dict(labels).get("replica") == LABELS["replica"]}


def assert_histogram(table, name, observed: list[float], bounds) -> None:
    """The histogram holds exactly `observed`: each bucket's count, the count and the sum."""
    expected = {float(bound): sum(1 for v in observed if v <= bound) for bound in bounds}
    expected[float("inf")] = len(observed)
    assert buckets_of(table, name) == expected, name
    assert value(table, f"{name}_count") == len(observed)
    assert value(table, f"{name}_sum") == pytest.approx(sum(observed), rel=1e-9, abs=1e-12)


def run(meter, requests) -> list[list]:
    """Every (prompt, params) through the meter at once; each one's deltas."""
    async def one(prompt, params):
        return [delta async for delta in meter.generate(prompt, params)]

    async def main():
        return await asyncio.gather(*(one(p, sp) for p, sp in requests))

    return asyncio.run(main())


def test_vllm_series_follow_a_real_engine_run(tmp_path):
    target, drafter = make_pair(tmp_path)
    llm = LLM(target, drafter, num_speculative_tokens=K, kv_cache_memory="4MiB",
              tokens_per_block=TOKENS_PER_BLOCK, max_num_seqs=4, max_model_len=MAX_MODEL_LEN)
    engine, metrics, meter = served(llm)
    before = samples(metrics.render().decode())
    assert value(before, "vllm:spec_decode_num_drafts_total") == 0
    assert [value(before, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(p))
            for p in range(K)] == [0] * K  # every position of K from the start
    assert value(before, "vllm:request_success_total", finished_reason="stop") == 0
    assert value(before, "dflash:kv_blocks_used", group="draft") == 0

    count = random.randint(3, 6)
    prompts = random_prompts(count, 160)
    max_tokens = [random.randint(8, 20) for _ in prompts]
    requests = [(p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
                for p, n in zip(prompts, max_tokens)]
    deltas = run(meter, requests)
    after = samples(metrics.render().decode())

    prompt_lens = [len(p) for p in prompts]
    assert [sum(len(d.token_ids) for d in ds) for ds in deltas] == max_tokens
    assert value(after, "vllm:prompt_tokens_total") == sum(prompt_lens)
    assert value(after, "vllm:generation_tokens_total") == sum(max_tokens)
    assert value(after, "vllm:request_success_total", finished_reason="length") == count
    assert value(after, "vllm:request_success_total", finished_reason="abort") == 0
    assert_histogram(after, "vllm:request_prompt_tokens", prompt_lens, one_two_five(MAX_MODEL_LEN))
    assert_histogram(after, "vllm:request_generation_tokens", max_tokens, one_two_five(MAX_MODEL_LEN))
    assert_histogram(after, "vllm:request_params_max_tokens", max_tokens, one_two_five(MAX_MODEL_LEN))

    # the phases, by hand from each request's moments; they add up as vLLM's do
    times = [t for t, reason, _ in metrics.requests]
    assert len(times) == count and {reason for _, reason, _ in metrics.requests} == {"length"}
    for t in times:
        assert t.arrival <= t.scheduled <= t.first_token <= t.last_token
    ttft = [t.first_token - t.arrival for t in times]
    queue = [t.scheduled - t.arrival for t in times]
    prefill = [t.first_token - t.scheduled for t in times]
    decode = [t.last_token - t.first_token for t in times]
    inference = [t.last_token - t.scheduled for t in times]
    e2e = [now - t.arrival for t, _, now in metrics.requests]
    tpot = [d / (n - 1) for d, n in zip(decode, [t.num_generation_tokens for t in times])]
    assert_histogram(after, "vllm:time_to_first_token_seconds", ttft, TTFT_BUCKETS)
    for name, observed in (("e2e_request_latency", e2e), ("request_queue_time", queue),
                           ("request_prefill_time", prefill), ("request_decode_time", decode),
                           ("request_inference_time", inference)):
        assert_histogram(after, f"vllm:{name}_seconds", observed, REQUEST_LATENCY_BUCKETS)
    assert_histogram(after, "vllm:request_time_per_output_token_seconds", tpot, TOKEN_LATENCY_BUCKETS)
    assert sum(queue) + sum(prefill) == pytest.approx(sum(ttft))
    # one inter-token observation per token after each request's first; together they are the decode
    assert value(after, "vllm:inter_token_latency_seconds_count") == sum(max_tokens) - count
    assert value(after, "vllm:inter_token_latency_seconds_sum") == pytest.approx(sum(decode))

    # the engine's side: speculative counters, steps, tokens per step (every prompt once, every token)
    stats, counters = llm.engine.stats, llm.engine.counters()
    assert value(after, "vllm:spec_decode_num_drafts_total") == stats.num_drafts > 0
    assert value(after, "vllm:spec_decode_num_draft_tokens_total") == stats.num_draft_tokens
    assert value(after, "vllm:spec_decode_num_accepted_tokens_total") == stats.num_accepted_tokens
    for position in range(K):
        accepted = stats.accepted_per_position[position] if position < len(stats.accepted_per_position) else 0
        name = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
        assert value(after, name, position=str(position)) == accepted
    assert value(after, "vllm:iteration_tokens_total_count") == counters.num_steps > 0
    assert value(after, "vllm:iteration_tokens_total_sum") == sum(prompt_lens) + sum(max_tokens)
    assert value(after, "vllm:num_preemptions_total") == counters.num_preemptions
    assert value(after, "dflash:engine_steps_total") == counters.num_steps
    steps_ahead = value(after, "dflash:engine_steps_ahead_total")
    assert 0 < steps_ahead == counters.num_steps_ahead < counters.num_steps
    assert value(after, "vllm:num_requests_running") == value(after, "vllm:num_requests_waiting") == 0
    assert value(after, "vllm:kv_cache_usage_perc") == 0.0
    assert value(after, "dflash:kv_blocks_used", group="target") == 0
    engine.shutdown()
    llm.close()


def test_prefix_cache_counters_count_the_tokens_a_repeated_prompt_finds(tmp_path):
    """Queries are every prompt token looked up, hits the full blocks restored (never the last token)."""
    target, _ = make_pair(tmp_path)
    llm = LLM(target, kv_cache_memory="4MiB", tokens_per_block=TOKENS_PER_BLOCK, max_num_seqs=2,
              max_model_len=MAX_MODEL_LEN)
    engine, metrics, meter = served(llm)
    prompt = random_prompts(1, 160, low=2 * TOKENS_PER_BLOCK + 1, high=5 * TOKENS_PER_BLOCK)[0]
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    for _ in range(2):  # one after the other: the second finds the first's full blocks
        run(meter, [(prompt, params)])
    table = samples(metrics.render().decode())
    assert value(table, "vllm:prefix_cache_queries_total") == 2 * len(prompt)
    full_blocks = (len(prompt) - 1) // TOKENS_PER_BLOCK  # the last prompt token is always recomputed
    assert value(table, "vllm:prefix_cache_hits_total") == full_blocks * TOKENS_PER_BLOCK
    engine.shutdown()
    llm.close()


def test_a_cancelled_request_is_an_abort_with_the_phases_it_reached(tmp_path):
    target, _ = make_pair(tmp_path)
    llm = LLM(target, kv_cache_memory="4MiB", tokens_per_block=TOKENS_PER_BLOCK, max_num_seqs=2,
              max_model_len=MAX_MODEL_LEN)
    engine, metrics, meter = served(llm)
    prompt = random_prompts(1, 160)[0]

    async def main():
        stream = meter.generate(prompt, SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
        received = [await anext(stream) for _ in range(3)]
        await stream.aclose()  # the client went away
        while meter.num_running:  # the engine drops it before this loop closes
            await asyncio.sleep(0.01)
        return received

    received = asyncio.run(main())
    table = samples(metrics.render().decode())
    assert value(table, "vllm:request_success_total", finished_reason="abort") == 1
    assert value(table, "vllm:generation_tokens_total") == sum(len(d.token_ids) for d in received)
    for name in ("e2e_request_latency", "request_queue_time", "request_prefill_time", "request_decode_time"):
        assert value(table, f"vllm:{name}_seconds_count") == 1
    engine.shutdown()
    llm.close()


def test_one_exposition_of_two_replicas_passes_promtool_and_sums_over_replica(tmp_path):
    """Two replicas' families merged: each series once, with its replica label; promtool finds nothing
    but what vLLM's own names bring (':' in every name, a histogram named `..._total`)."""
    target, drafter = make_pair(tmp_path)
    llms = [LLM(target, drafter, num_speculative_tokens=K, kv_cache_memory="4MiB",
                max_model_len=MAX_MODEL_LEN, tokens_per_block=TOKENS_PER_BLOCK, max_num_seqs=4)
            for _ in range(2)]
    replicas = []
    for rank, llm in enumerate(llms):
        engine = AsyncEngine(llm.engine)
        metrics = ServerMetrics(engine, llm.engine.counters, model_name="demo", replica=str(rank),
                                max_model_len=MAX_MODEL_LEN, num_speculative_tokens=K)
        meter = MeteredEngine(engine, metrics)
        llm.engine.on_scheduled = meter.scheduled
        run(meter, [(p, SamplingParams(max_tokens=random.randint(4, 12), temperature=0))
                    for p in random_prompts(random.randint(1, 3), 160)])
        replicas.append((engine, metrics))
    text = render(merge([metrics.families() for _, metrics in replicas] * 2)).decode()  # each rank once
    table = samples(text)
    drafts = [llm.engine.stats.num_drafts for llm in llms]
    drafted = [v for (name, _), v in table.items() if name == "vllm:spec_decode_num_drafts_total"]
    assert len(drafted) == 2 and sum(drafted) == sum(drafts)  # what a PromQL sum over replica adds
    ranks = {dict(labels)["replica"] for (name, labels) in table if name == "vllm:generation_tokens_total"}
    assert ranks == {"0", "1"}
    check_metrics(text)
    for engine, _ in replicas:
        engine.shutdown()
    for llm in llms:
        llm.close()


def test_kernel_compilations_are_counted_by_phase(tmp_path, monkeypatch):
    """What compiled before the engine was ready is start-up; anything after it stalled the step."""
    from kernels.compile_watch import CompileWatch
    from target_service.engine import async_engine

    watch = CompileWatch()
    monkeypatch.setattr(async_engine, "WATCH", watch)
    target, _ = make_pair(tmp_path)
    llm = LLM(target, kv_cache_memory="4MiB", tokens_per_block=16, max_num_seqs=2, max_model_len=64)
    engine = AsyncEngine(llm.engine)
    metrics = ServerMetrics(engine, llm.engine.counters, model_name="demo", replica="3", max_model_len=64)
    built = {"startup": 0, "serving": 0}
    for phase in ["startup"] * 3 + ["serving"] * 2:
        if phase == "serving":
            watch.mark_ready()
        watch._on_miss(fn=None, compile={"signature": {"n": "i32"}}, repr="")
        built[phase] += 1
        table = samples(metrics.render().decode())
        for name, count in built.items():
            assert value(table, "dflash:kernel_compilations_total", service="in_process", phase=name) == count
    engine.shutdown()
    llm.close()


def test_the_proposer_series_split_the_speculative_counters_by_who_drafted(tmp_path):
    """A hybrid engine: per proposer, the four counters are the engine's counts of that proposer, and
    over the proposers they add up to vLLM's totals; the exposition stays valid."""
    target, drafter = make_pair(tmp_path)
    llm = LLM(target, drafter, speculative_method="hybrid", num_speculative_tokens=K, kv_cache_memory="4MiB",
              tokens_per_block=TOKENS_PER_BLOCK, max_num_seqs=4, max_model_len=MAX_MODEL_LEN)
    engine, metrics, meter = served(llm)
    phrase = random_prompts(1, 160, low=4, high=7)[0]
    prompts = [phrase * 5, *random_prompts(2, 160)]  # one the lookup can copy from, two it cannot
    run(meter, [(p, SamplingParams(max_tokens=random.randint(16, 30), temperature=0, ignore_eos=True))
                for p in prompts])
    text = metrics.render().decode()
    table, by_proposer = samples(text), llm.engine.stats.by_proposer
    assert set(by_proposer) == {"dflash", "ngram"}
    for series, read in (("num_drafts", "num_drafts"), ("num_draft_tokens", "num_draft_tokens"),
                         ("num_accepted_tokens", "num_accepted_tokens")):
        per = {name: value(table, f"dflash:spec_decode_proposer_{series}_total", proposer=name)
               for name in by_proposer}
        assert per == {name: getattr(counts, read) for name, counts in by_proposer.items()}
        assert sum(per.values()) == value(table, f"vllm:spec_decode_{series}_total") > 0
    for position in range(K):
        name = "dflash:spec_decode_proposer_num_accepted_tokens_per_pos_total"
        per = [value(table, name, proposer=p, position=str(position)) for p in by_proposer]
        total = value(table, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(position))
        assert sum(per) == total
    engine.shutdown()
    llm.close()
    check_metrics(text)  # last: it skips where there is no promtool
