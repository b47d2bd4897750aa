"""step_compare merges separate step-bench runs: random synthetic runs, each case's ratio recomputed
here from the raw tok/s, the table's cells found in the markdown, and bad input refused by name."""

from __future__ import annotations

import json
import random

import pytest

from dflash_cli.bench.step_compare import compare, main, markdown


def case(rng: random.Random, batch: int, context: int, steps=None) -> dict:
    median = rng.uniform(5e-3, 30e-3)
    graphs = {"median": median, "p10": median * 0.98, "p90": median * 1.03,
              "tokens_per_s": rng.uniform(500, 12_000), "mean_acceptance_length": rng.uniform(4, 7)}
    return {"batch": batch, "context": context, "graphs": graphs, "decode_steps_by_drafts": steps}


def run(rng, keys, k: int, adaptive: bool, plain: bool = False) -> dict:
    steps = {"15": rng.randint(1, 99), "0": rng.randint(1, 9), "7": rng.randint(1, 99)} if adaptive else None
    return {"num_speculative_tokens": k, "adaptive_speculation": adaptive, "commit": "abc1234",
            "device": "test", "date": "today", "command": f"k {k}", "simulate_acceptance": 6.5,
            "acceptance_curve": "geometric",
            "dflash": [case(rng, b, c, steps) for b, c in keys],
            "plain": [case(rng, b, c) for b, c in keys] if plain else []}


def test_the_adaptive_run_is_divided_by_the_best_fixed_run_of_each_case(tmp_path):
    rng = random.Random()
    keys = [(b, c) for c in (2048, 8192) for b in rng.sample([1, 8, 32, 64], 2)]
    runs = [run(rng, keys, 15, False, plain=True), run(rng, keys, 7, False), run(rng, keys, 15, True)]
    rng.shuffle(runs)  # labelled by what each engine did, not by position
    merged = compare(runs)
    assert sorted(merged["labels"]) == ["K 15", "K 7", "adaptive K 15"]
    by_label = {("adaptive K 15" if r["adaptive_speculation"] else f"K {r['num_speculative_tokens']}"): r
                for r in runs}
    for row in merged["rows"]:
        key = (row["batch"], row["context"])
        tps = {lab: next(c["graphs"]["tokens_per_s"] for c in r["dflash"]
                         if (c["batch"], c["context"]) == key) for lab, r in by_label.items()}
        expected = tps["adaptive K 15"] / max(tps["K 15"], tps["K 7"])
        assert row["runs"]["adaptive K 15"]["over_best_fixed"] == pytest.approx(expected)
    text = markdown(merged, "t")
    first = merged["rows"][0]
    assert f"| {first['batch']} | {first['context']} | {first['plain_ms']:.2f} |" in text
    assert f"{first['runs']['adaptive K 15']['over_best_fixed']:.3f}" in text
    main([*map(str, _write(tmp_path, runs)), "--out", str(tmp_path / "o"), "--name", "n"])
    written = json.loads((tmp_path / "o" / "n.json").read_text())
    assert written["rows"] == json.loads(json.dumps(merged["rows"]))


def test_two_runs_of_one_engine_and_a_file_that_is_not_a_result_are_refused(tmp_path, capsys):
    rng = random.Random()
    twice = [run(rng, [(1, 2048)], 15, False), run(rng, [(1, 2048)], 15, False)]
    with pytest.raises(SystemExit):
        main([*map(str, _write(tmp_path, twice)), "--out", str(tmp_path / "o")])
    assert "two runs of the same engine" in capsys.readouterr().err
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(SystemExit):
        main([str(broken), "--out", str(tmp_path / "o")])
    assert "broken.json: not a step-bench result" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()  # nothing written


def _write(tmp_path, runs):
    paths = []
    for i, record in enumerate(runs):
        path = tmp_path / f"run{i}.json"
        path.write_text(json.dumps(record))
        paths.append(path)
    return paths
