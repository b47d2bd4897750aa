"""What `dflash bench serve` sends (dflash_cli.bench.serve_workload): lengths from a flag or a file, and
the passes of each setting.

Oracles: the bounds and frequencies of a uniform distribution (every value of a small range drawn, each
about equally often), a file's own values and their multiplicities, hand-written error messages with
the line numbers counted by hand, and hand-made pass sequences. Fresh seeds are drawn per run and named
in every assertion message.
"""

import argparse
import json
import random
import secrets
from collections import Counter

import pytest

from dflash_cli.bench.serve_load import add_arguments, check_args
from dflash_cli.bench.serve_workload import (
    Prompt,
    draw_prompts,
    parse_length,
    plan_passes,
    plan_run,
    read_lens_file,
)

URL = "http://127.0.0.1:1/v1"


def cli(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--url", URL, *flags])


@pytest.fixture
def seed() -> int:
    return secrets.randbits(32)


def test_a_range_draws_every_length_from_min_to_max_about_equally_often(seed):
    rng = random.Random(seed)
    low = rng.randint(1, 50)
    high = low + rng.randint(1, 9)
    lengths = parse_length("--input-len", f"{low}-{high}")
    drawn = lengths.sample(4000, random.Random(seed))
    counts = Counter(drawn)
    assert set(counts) == set(range(low, high + 1)), f"seed {seed}"  # both bounds hit, nothing outside
    expected = 4000 / (high - low + 1)
    assert all(abs(n - expected) < 0.25 * expected for n in counts.values()), f"seed {seed}: {counts}"
    assert drawn == lengths.sample(4000, random.Random(seed))  # seeded
    assert drawn != lengths.sample(4000, random.Random(seed + 1))


@pytest.mark.parametrize("text, low, high", [("64", 64, 64), ("8-64", 8, 64), (" 3 - 9 ", 3, 9),
                                             ("1-1", 1, 1), (7, 7, 7)])
def test_a_length_flag_is_one_integer_or_a_range(text, low, high):
    lengths = parse_length("--output-len", text)
    assert (lengths.low, lengths.high, lengths.values) == (low, high, None)
    assert set(lengths.sample(50, random.Random(0))) <= set(range(low, high + 1))


@pytest.mark.parametrize("text", ["9-3", "0-5", "abc", "5-", "-5-9", "1.5", "", "3-4-5", "1e3"])
def test_a_bad_length_flag_is_one_line_naming_the_flag(text):
    with pytest.raises(ValueError) as error:
        parse_length("--input-len", text)
    assert str(error.value) == f"--input-len: expected N or MIN-MAX with 1 <= MIN <= MAX, got {text!r}"


@pytest.mark.parametrize("text, shown", [("0", 0), ("-3", -3), (0, 0), (" -12 ", -12)])
def test_a_single_length_below_one_says_so_like_every_count_flag(text, shown):
    with pytest.raises(ValueError) as error:
        parse_length("--output-len", text)
    assert str(error.value) == f"--output-len: must be at least 1, got {shown}"


@pytest.mark.parametrize("write", [
    lambda values: "\n".join(map(str, values)) + "\n",
    lambda values: "\n\n".join(map(str, values)) + "\n\n",  # blank lines are skipped
    lambda values: json.dumps(values),
    lambda values: json.dumps(values, indent=2),
])
def test_a_lens_file_is_sampled_with_replacement_in_proportion_to_its_values(write, tmp_path, seed):
    rng = random.Random(seed)
    values = [rng.randint(1, 4000) for _ in range(rng.randint(3, 12))]
    values += [values[0]] * len(values)  # the first value is half the file
    (tmp_path / "lens").write_text(write(values))
    lengths = read_lens_file("--input-lens-file", str(tmp_path / "lens"))
    assert sorted(lengths.values) == sorted(values)
    assert (lengths.low, lengths.high) == (min(values), max(values))
    drawn = lengths.sample(6000, random.Random(seed))
    assert set(drawn) == set(values), f"seed {seed}"
    assert abs(drawn.count(values[0]) / 6000 - values.count(values[0]) / len(values)) < 0.04, f"seed {seed}"
    assert drawn == lengths.sample(6000, random.Random(seed))


@pytest.mark.parametrize("text, where", [
    ("12\n7\n0\n", "line 3: expected a positive integer, got '0'"),
    ("12\n\n-3\n", "line 3: expected a positive integer, got '-3'"),
    ("4\n2.5\n", "line 2: expected a positive integer, got '2.5'"),
    ("abc\n", "line 1: expected a positive integer, got 'abc'"),
    ("[1, 2,\n 3,\n 0]", "line 3: expected a positive integer, got '0'"),
    ("[\n  5,\n  true\n]", "line 3: expected a positive integer, got 'true'"),
    ('[1, "7"]', "line 1: expected a positive integer, got '\"7\"'"),
    ("[3.5]", "line 1: expected a positive integer, got '3.5'"),
    ("[1,\n [2]]", "line 2: expected a positive integer, got '[2]'"),
    ("[1, 2,\n", "line 2: not a JSON list (Expecting value)"),
    ("", "is empty (expected one integer per line, or a JSON list)"),
    ("\n  \n", "is empty (expected one integer per line, or a JSON list)"),
    ("[]", "is empty (expected one integer per line, or a JSON list)"),
])
def test_a_bad_lens_file_names_the_file_and_line(text, where, tmp_path):
    path = tmp_path / "lens.txt"
    path.write_text(text)
    with pytest.raises(ValueError) as error:
        read_lens_file("--output-lens-file", str(path))
    assert str(error.value) == f"--output-lens-file: {path} {where}"
    assert "\n" not in str(error.value)


def test_a_missing_or_binary_lens_file_is_named(tmp_path):
    with pytest.raises(ValueError, match=rf"^--input-lens-file: no file {tmp_path}/none$"):
        read_lens_file("--input-lens-file", str(tmp_path / "none"))
    (tmp_path / "bin").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ValueError, match=r"^--input-lens-file: .*/bin is not text$"):
        read_lens_file("--input-lens-file", str(tmp_path / "bin"))


@pytest.mark.parametrize("flags, message", [
    (["--input-len", "9-3"], "--input-len: expected N or MIN-MAX with 1 <= MIN <= MAX, got '9-3'"),
    (["--output-len", "0"], "--output-len: must be at least 1, got 0"),
    (["--output-len", "4-2"], "--output-len: expected N or MIN-MAX with 1 <= MIN <= MAX, got '4-2'"),
    (["--input-lens-file", "/no/such/lens"], "--input-lens-file: no file /no/such/lens"),
    (["--passes", "repeat", "new"], "--passes: the first pass must be new (a repeat sends the pass before it "
                                    "again), got 'repeat new'"),
    (["--gap-threshold-ms", "0"], "--gap-threshold-ms: must be > 0, got 0.0"),
    (["--metrics-counter", "ok_total", "--metrics-counter", "bad name"],
     "--metrics-counter: expected a Prometheus sample name, got 'bad name'"),
])
def test_check_args_refuses_each_bad_new_flag_in_one_line(flags, message):
    with pytest.raises(ValueError) as error:
        check_args(cli("--concurrency", "1", *flags))
    assert str(error.value) == message


def test_a_length_and_a_lens_file_for_the_same_side_are_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        cli("--concurrency", "1", "--input-len", "5", "--input-lens-file", "f")
    assert "not allowed with argument" in capsys.readouterr().err


def test_the_defaults_are_todays_one_new_pass_with_a_warm_up():
    args = cli("--concurrency", "1")
    check_args(args)
    assert (args.input_len, args.output_len, args.passes, args.cold) == ("64", "128", ["new"], False)
    assert args.gap_threshold_ms == 250.0 and args.metrics_counter is None


@pytest.mark.parametrize("kinds, settings, draws", [
    (["new"], 3, [[0], [1], [2]]),
    (["new", "repeat", "repeat", "new"], 2, [[0, 0, 0, 1], [2, 2, 2, 3]]),
    (["new", "new", "repeat"], 1, [[0, 1, 1]]),
])
def test_each_new_pass_of_the_run_gets_its_own_draw_and_a_repeat_its_predecessors(kinds, settings, draws):
    assert plan_passes(kinds, settings) == draws


def fake_source(count: int, length: int, seed: int) -> list[list[int]]:
    """Seeded random ids from a vocabulary so large that two prompts never share a first token."""
    rng = random.Random(seed)
    return [[rng.randrange(1 << 40) for _ in range(length)] for _ in range(count)]


def test_draw_prompts_cuts_each_window_to_its_seeded_length(seed):
    inputs, outputs = parse_length("--input-len", "5-40"), parse_length("--output-len", "1-9")
    drawn = draw_prompts(2000, inputs, outputs, seed, fake_source)
    windows = fake_source(2000, max(len(p.token_ids) for p in drawn), seed)
    assert [p.token_ids for p in drawn] == [w[:len(p.token_ids)] for w, p in zip(windows, drawn)]
    assert {len(p.token_ids) for p in drawn} == set(range(5, 41)), f"seed {seed}"  # the bounds included
    assert {p.max_tokens for p in drawn} == set(range(1, 10)), f"seed {seed}"
    assert drawn == draw_prompts(2000, inputs, outputs, seed, fake_source)


def test_the_plan_repeats_exactly_the_previous_prompts_and_news_are_fresh_of_the_same_lengths(seed):
    args = cli("--concurrency", "2", "4", "--num-prompts", "30", "--input-len", "3-20", "--output-len", "2-6",
               "--passes", "new", "repeat", "repeat", "new", "--seed", str(seed))
    plan = plan_run(args, fake_source)
    assert [(s.mode, s.value) for s in plan.settings] == [("concurrency", 2), ("concurrency", 4)]
    firsts = lambda prompts: {p.token_ids[0] for p in prompts}
    seen = firsts([plan.warmup])
    for setting in plan.settings:
        new1, repeat1, repeat2, new2 = setting.passes
        assert [p.kind for p in setting.passes] == ["new", "repeat", "repeat", "new"]
        assert repeat1.prompts == new1.prompts and repeat2.prompts == new1.prompts  # exactly, in order
        for fresh in (new1, new2):
            assert len(fresh.prompts) == 30 and not firsts(fresh.prompts) & seen  # no earlier prompt again
            assert {len(p.token_ids) for p in fresh.prompts} <= set(range(3, 21))
            assert {p.max_tokens for p in fresh.prompts} <= set(range(2, 7))
            seen |= firsts(fresh.prompts)
    assert len(seen) == 1 + 4 * 30
    assert plan_run(args, fake_source) == plan  # seeded


def test_cold_drops_the_warm_up_but_measures_the_same_prompts():
    flags = ["--concurrency", "1", "--num-prompts", "5", "--input-len", "4-9"]
    warm, cold = plan_run(cli(*flags), fake_source), plan_run(cli(*flags, "--cold"), fake_source)
    assert isinstance(warm.warmup, Prompt) and cold.warmup is None
    assert cold.settings == warm.settings
