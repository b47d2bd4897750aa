"""Batch-1 timing side by side: medians, spreads and per-round ratios, under a clock the test controls."""

import training.evaluate as evaluate


class FakeClock:
    """perf_counter that only moves when a runner 'works'; a slow phase makes every runner slower."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_ratios_are_taken_within_rounds_so_a_slow_host_phase_cancels(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(evaluate.time, "perf_counter", clock)
    calls = {"n": 0}

    def runner(seconds_per_token: float, tokens: int):
        def generate(prompt):
            calls["n"] += 1
            slowdown = 3.0 if calls["n"] > 40 else 1.0  # the host gets 3x slower half way through
            clock.now += seconds_per_token * tokens * slowdown
            return tokens
        return generate

    timing = evaluate.timed_side_by_side(
        {"plain": runner(0.010, 8), "dflash": runner(0.004, 8)}, prompts=[[1], [2], [3], [4]], rounds=6)
    assert timing["rounds"] == 6
    # 2 warm-up calls, then 8 per round: rounds 1-4 fast (calls 3..34), round 5 mixed, round 6 slow
    assert timing["plain"]["max"] == 100.0 and round(timing["plain"]["min"], 2) == 33.33
    assert timing["dflash"]["speedup"] == 2.5  # 0.010 / 0.004, whatever the host's speed
    assert timing["dflash"]["speedup_min"] >= 2.0 and timing["dflash"]["speedup_max"] <= 3.2
