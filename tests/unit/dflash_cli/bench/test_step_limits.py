"""The limits sweep of the step bench: which engines it starts, what it times, what it records."""

from __future__ import annotations

import random
from types import SimpleNamespace

from dflash_cli.bench.step_limits import limit_configs, limits_sweep
from dflash_cli.bench.step_report import markdown


def test_configs_vary_one_limit_at_a_time_and_name_the_default_pair_once():
    seqs = random.sample(range(1, 512), 3)
    configs = limit_configs([*seqs, 64], ["16GiB", "8GiB"], default_seqs=64, default_memory=None)
    assert configs == [*((s, None) for s in seqs), (64, None), (64, "16GiB"), (64, "8GiB")]
    assert limit_configs([], [], default_seqs=8, default_memory="1GiB") == []


class FakeLLM:
    def __init__(self, max_num_seqs, memory):
        if memory == "tiny":
            raise ValueError("a KV budget of tiny holds 0 blocks")
        self.engine = SimpleNamespace(pool_limits=SimpleNamespace(num_blocks=max_num_seqs * 10))
        self.closed = False
        started.append(self)

    def close(self):
        self.closed = True


started: list[FakeLLM] = []


def test_the_sweep_times_each_batch_that_fits_and_records_an_engine_that_cannot_start():
    started.clear()
    median = random.uniform(0.001, 0.05)

    def case(llm, batch, context):
        spread = {"median": median * batch, "p10": median, "p90": 2 * median, "gpu_busy_ms": 1.5}
        return {"batch": batch, "context": context, "prefill_s": 0.1, "graphs": spread,
                "eager": spread, "not_kept": 1}

    configs = [(4, None), (32, None), (32, "tiny")]
    rows = limits_sweep(FakeLLM, case, configs, [1, 8, 32], 2048)
    timed = [(row["max_num_seqs"], row.get("batch")) for row in rows]
    assert timed == [(4, 1), (32, 1), (32, 8), (32, 32), (32, None)]
    assert rows[-1]["error"] == "a KV budget of tiny holds 0 blocks"
    assert rows[0]["pool_blocks"] == 40 and rows[1]["kv_cache_memory"] == "default"
    assert "not_kept" not in rows[0] and rows[3]["graphs"]["median"] == median * 32
    assert len(started) == 2 and all(llm.closed for llm in started)
    report = markdown({"name": "t", "device": "cpu", "torch": "-", "commit": "-", "date": "-", "command": "-",
                       "geometry": "tiny", "dtype": "float32", "simulate_acceptance": 6.5, "steps": 1,
                       "plain": [], "dflash": [], "hf": [], "skipped": [], "limits": rows})
    assert f"| 32 | default | 320 | {rows[1]['startup_s']} | 32 | 2048 | {median * 32e3:.2f} (" in report
    assert "not started: a KV budget of tiny holds 0 blocks" in report
