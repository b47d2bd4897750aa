"""The replica's metrics move as requests run: speculative counters equal the engine's own stats,
per-request histograms count what was observed, pool gauges return to zero used blocks."""

import asyncio

from engine_helpers import make_pair, random_prompts
from prometheus_client.parser import text_string_to_metric_families

from target_service.engine.async_engine import AsyncEngine
from target_service.engine.sampling_params import SamplingParams
from target_service.llm import LLM
from target_service.serving.metrics import ServerMetrics


def samples(metrics: ServerMetrics) -> dict:
    """(sample name, frozen labels) -> value, parsed back from the exposition text."""
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            out[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return out


def value(table, name, **labels):
    base = {"model_name": "demo", "replica": "3"}
    return table[(name, frozenset({**base, **labels}.items()))]


def test_metrics_follow_the_engine_and_the_observed_requests(tmp_path):
    target, drafter = make_pair(tmp_path)
    llm = LLM(target, drafter, num_speculative_tokens=3, kv_cache_memory="4MiB", tokens_per_block=16,
              max_num_seqs=4, max_model_len=128)
    engine = AsyncEngine(llm.engine)
    metrics = ServerMetrics(engine, model_name="demo", replica="3", groups=["target", "draft"])
    before = samples(metrics)
    assert value(before, "dflash:spec_decode_num_drafts_total") == 0
    assert value(before, "dflash:kv_blocks_used", group="draft") == 0

    async def run(prompt):
        return [d async for d in engine.generate(prompt, SamplingParams(max_tokens=12, temperature=0,
                                                                        ignore_eos=True))]

    async def main():
        return await asyncio.gather(*(run(p) for p in random_prompts(3, 160)))

    asyncio.run(main())
    for total in (0.5, 1.0, 2.0):
        metrics.observe(first_token_s=0.1, total_s=total, num_output_tokens=12, finish_reason="length")
    after = samples(metrics)
    stats = llm.engine.stats
    assert value(after, "dflash:spec_decode_num_drafts_total") == stats.num_drafts > 0
    assert value(after, "dflash:spec_decode_num_draft_tokens_total") == stats.num_draft_tokens
    assert value(after, "dflash:spec_decode_num_accepted_tokens_total") == stats.num_accepted_tokens
    for position, count in enumerate(stats.accepted_per_position):
        name = "dflash:spec_decode_num_accepted_tokens_per_pos_total"
        assert value(after, name, position=str(position)) == count
    assert value(after, "dflash:request_success_total", finished_reason="length") == 3
    assert value(after, "dflash:e2e_request_latency_seconds_count") == 3
    assert value(after, "dflash:e2e_request_latency_seconds_sum") == 3.5
    assert abs(value(after, "dflash:time_per_output_token_seconds_sum") - (0.4 + 0.9 + 1.9) / 11) < 1e-12
    assert value(after, "dflash:engine_steps_total") == llm.engine.counters().num_steps > 0
    steps_ahead = value(after, "dflash:engine_steps_ahead_total")
    assert 0 < steps_ahead == llm.engine.counters().num_steps_ahead < llm.engine.counters().num_steps
    assert value(after, "dflash:num_requests_running") == 0
    assert value(after, "dflash:kv_blocks_used", group="target") == 0
    engine.shutdown()
    llm.close()


def test_kernel_compilations_are_counted_by_phase(tmp_path, monkeypatch):
    """What compiled before the engine was ready is start-up; anything after it stalled the step."""
    from kernels.compile_watch import CompileWatch
    from target_service.serving import metrics as metrics_module

    watch = CompileWatch()
    monkeypatch.setattr(metrics_module, "WATCH", watch)
    target, _ = make_pair(tmp_path)
    llm = LLM(target, kv_cache_memory="4MiB", tokens_per_block=16, max_num_seqs=2, max_model_len=64)
    engine = AsyncEngine(llm.engine)
    metrics = ServerMetrics(engine, model_name="demo", replica="3")
    built = {"startup": 0, "serving": 0}
    for phase in ["startup"] * 3 + ["serving"] * 2:
        if phase == "serving":
            watch.mark_ready()
        watch._on_miss(fn=None, compile={"signature": {"n": "i32"}}, repr="")
        built[phase] += 1
        table = samples(metrics)
        for name, count in built.items():
            assert value(table, "dflash:kernel_compilations_total", phase=name) == count
    engine.shutdown()
    llm.close()
