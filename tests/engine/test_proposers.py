"""Prompt lookup ("ngram") and the hybrid proposer are lossless: greedy outputs equal target-only
greedy decoding bit for bit, for prompts that repeat themselves (where lookup is accepted) and random
ones, batched, with prefix caching and preemption; the hybrid keeps the DFlash drafter's context whole
whichever proposer drafted, so DFlash drafts as well after lookup steps as in a DFlash-only run.
Bad settings are refused with one line naming the setting."""

from __future__ import annotations

import functools

import pytest
import torch
from engine_helpers import PositionRecorder, make_pair, random_prompts
from near_ties import assert_equal_up_to_a_near_tie
from ngram_reference import common_prefix, search_from_scratch

from drafter_service.control import DrafterUnavailable
from target_service.engine.sampling_params import SamplingParams
from target_service.llm import LLM
from target_service.proposers import hybrid
from target_service.proposers.deferred_context import DeferredContext
from target_service.proposers.hybrid_choice import StepChoice
from target_service.runner import model_runner
from target_service.runner.context_rows import ContextRows, RowSelection

SETTINGS = dict(kv_cache_memory="4MiB", tokens_per_block=16, max_num_seqs=8, max_model_len=160)
GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


def repeating_prompts(count: int, vocab_size: int) -> list[list[int]]:
    """Prompts made of a short random phrase said again and again, with noise between: the
    continuation a lookup can find in them."""
    prompts = []
    for _ in range(count):
        phrase = torch.randint(3, vocab_size, (int(torch.randint(3, 8, ()).item()),)).tolist()
        noise = torch.randint(3, vocab_size, (int(torch.randint(0, 4, ()).item()),)).tolist()
        prompts.append((phrase + noise) * 3 + phrase[:2])
    return prompts


def outputs(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params)]


def assert_greedy_equal(target, prompts, got: list[list[int]], expected: list[list[int]]) -> None:
    """Equal to target-only greedy decoding, or parted only at a near-tie of the target's logits: on a
    CPU a verify's few-row products and a decode's one-row product may round differently (seen once in
    a full test run on fresh random models and prompts)."""
    assert len(got) == len(expected)
    for prompt, ours, reference in zip(prompts, got, expected):
        assert_equal_up_to_a_near_tie(target, prompt, ours, reference)


def plain(target, prompts, params=GREEDY) -> list[list[int]]:
    llm = LLM(target, **SETTINGS)
    try:
        return outputs(llm, prompts, params)
    finally:
        llm.close()


@pytest.mark.parametrize("method", ["ngram", "hybrid"])
@pytest.mark.parametrize("num_draft", [2, 7])
def test_greedy_with_lookup_equals_target_only(tmp_path, method, num_draft):
    target, drafter = make_pair(tmp_path)
    prompts = repeating_prompts(4, 160) + random_prompts(3, 160)
    expected = plain(target, prompts)
    llm = LLM(target, drafter if method == "hybrid" else None, speculative_method=method,
              num_speculative_tokens=num_draft, **SETTINGS)
    try:
        assert_greedy_equal(target, prompts[:1], outputs(llm, prompts[:1]), expected[:1])  # alone, batched
        assert_greedy_equal(target, prompts, outputs(llm, prompts), expected)
        assert_greedy_equal(target, prompts, outputs(llm, prompts), expected)  # again, over the prefix cache
        assert llm.stats.num_drafts > 0 and llm.stats.num_accepted_tokens > 0
        usage = llm.engine.pool_usage()
        assert usage.num_used_blocks == 0 and usage.num_seqs == 0
    finally:
        llm.close()


def test_lookup_is_lossless_under_preemption(tmp_path):
    """A pool too small for the batch preempts and recomputes; each index starts over from the tokens."""
    target, _ = make_pair(tmp_path)
    prompts = repeating_prompts(6, 160)
    expected = plain(target, prompts)
    llm = LLM(target, speculative_method="ngram", num_speculative_tokens=5,
              **{**SETTINGS, "kv_cache_memory": "96KiB"})
    try:
        assert_greedy_equal(target, prompts, outputs(llm, prompts), expected)
        assert llm.engine.counters().num_preemptions > 0
    finally:
        llm.close()


def test_each_lookup_step_accepts_what_a_search_from_scratch_predicts(tmp_path):
    """The engine's counts equal a replay of its output: at each step the from-scratch lookup's
    proposal, of which the drafts that may count (K, capped by max_tokens and max_model_len) are
    accepted up to the first that differs from the tokens that followed."""
    target, _ = make_pair(tmp_path)
    prompts = repeating_prompts(3, 160)
    num_draft, max_tokens, lookup = 4, 60, dict(max_ngram=3, min_ngram=1)
    llm = LLM(target, speculative_method="ngram", num_speculative_tokens=num_draft, **SETTINGS)
    try:
        results = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    finally:
        llm.close()
    for prompt, result in zip(prompts, results):
        tokens = prompt + result.outputs[0].token_ids
        known, drafts, drafted, accepted = len(prompt) + 1, 0, 0, 0
        while known - len(prompt) < max_tokens:
            may_count = min(num_draft, SETTINGS["max_model_len"] - (known - 1) - 2,
                            max_tokens - (known - len(prompt)) - 1)
            if may_count <= 0:
                known += 1
                continue
            proposal, _ = search_from_scratch(tokens[:known], num_draft, **lookup)
            hits = common_prefix(proposal[:may_count], tokens[known:known + may_count])
            drafts, drafted, accepted = drafts + 1, drafted + may_count, accepted + hits
            known += hits + 1
        stats = result.spec_decode
        counted = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
        assert counted == (drafts, drafted, accepted)
    assert sum(result.spec_decode.num_accepted_tokens for result in results) > 0


def switching_back(every: int):
    """The hybrid's own choice, except that every `every`-th step runs the drafter for every row: the
    real choice follows this machine's step times, and under a loaded test run it can keep the lookup
    to the end, so DFlash would never draft after a lookup step and the test below would show nothing."""
    real, calls = hybrid.choose_step, iter(range(1, 10**9))

    def choose(rows, time_with, time_without):
        if next(calls) % every == 0:
            return StepChoice(True, ())
        return real(rows, time_with, time_without)
    return choose


def test_hybrid_keeps_the_drafters_context_whole(tmp_path, monkeypatch):
    """At every position both reach, the hybrid's DFlash proposal equals a DFlash-only engine's, also
    after steps the lookup drafted: the context store ran for every accepted position whichever
    proposer drafted (a gap in the context would change what DFlash proposes after it)."""
    monkeypatch.setattr(hybrid, "choose_step", switching_back(int(torch.randint(3, 6, ()).item())))
    target, drafter = make_pair(tmp_path)
    prompts = repeating_prompts(4, 160)
    expected = plain(target, prompts)
    recorded = {}
    lookup_from = {}  # prompt -> the first position the lookup drafted
    for method in ("hybrid", "dflash"):
        llm = LLM(target, drafter, speculative_method=method, num_speculative_tokens=5, **SETTINGS)
        runner = llm.assembly.runner
        proposer = runner.drafter
        inner = proposer.dflash if method == "hybrid" else proposer
        recorder = PositionRecorder(inner, runner.step_buffers, llm.engine)
        if method == "hybrid":
            proposer.dflash = recorder
            propose = proposer.propose

            def noting(num_seqs, num_draft, columns, propose=propose, proposer=proposer):
                propose(num_seqs, num_draft, columns)
                for seq, source in zip(proposer.staged, proposer.sources):
                    if source == "ngram":
                        lookup_from.setdefault(tuple(seq.prompt_token_ids), seq.num_computed)
            proposer.propose = noting
        else:
            runner.swap_drafter(recorder)
        try:
            assert outputs(llm, prompts) == expected
        finally:
            llm.close()
        recorded[method] = recorder.proposals
    assert lookup_from, "the lookup never drafted: the test shows nothing"
    common = recorded["hybrid"].keys() & recorded["dflash"].keys()
    after_lookup = [key for key in common if key[0] in lookup_from and key[1] > lookup_from[key[0]]]
    assert after_lookup, "no position after a lookup step was drafted by both"
    for key in common:
        assert recorded["hybrid"][key] == recorded["dflash"][key], key


def scripted_choice(cycle: int):
    """A hybrid choice that skips the drafter for cycle - 1 steps, then runs it (every row on DFlash):
    the context of those lookup-only steps is deferred, and stored just before DFlash reads it."""
    calls = iter(range(10**9))

    def choose(rows, time_with, time_without):
        if next(calls) % cycle == cycle - 1:
            return StepChoice(True, ())
        return StepChoice(False, tuple(range(len(rows))))
    return choose


def unpicked_rows(batch, seqs, accepted, taps):
    """`context_rows` in a GPU engine's form, on any device: every tap row, picked when staged."""
    return ContextRows(taps, RowSelection.of(batch, seqs, accepted))


@pytest.mark.parametrize(("kv_cache_memory", "rows_form", "room"), [
    ("4MiB", "kept", None), ("256KiB", "kept", None), ("4MiB", "unpicked", None), ("4MiB", "kept", 40)])
def test_deferred_context_is_whole_when_dflash_reads_it_and_when_pages_go_back(tmp_path, monkeypatch,
                                                                              kv_cache_memory, rows_form,
                                                                              room):
    """The context of lookup-only and prefill-only steps is held and stored later; DFlash must still
    read exactly a DFlash-only engine's context at every position both reach: after deferred steps
    (stored before it drafts), in a second round whose prompts continue the first round's outputs
    (their blocks are prefix hits whose context was held when the first round's sequences finished:
    stored before their pages went back), and, in a pool too small for the batch, across preemption.
    Also with the rows in a GPU engine's form (every tap row, held unpicked and picked together when
    stored), in both engines; and with room for few rows held, where a step whose rows do not fit
    stores what is held and is held in its place (7 lookup-only steps between drafter steps: six
    sequences keep at least a row each a step, 42 or more, so the hold of 40 fills while no step's
    rows, at most 6 x 6 = 36, are more than it holds)."""
    cycle = 8 if room is not None else int(torch.randint(3, 6, ()).item())
    monkeypatch.setattr(hybrid, "choose_step", scripted_choice(cycle))
    if rows_form == "unpicked":
        monkeypatch.setattr(model_runner, "context_rows", unpicked_rows)
    if room is not None:
        monkeypatch.setattr(hybrid, "DeferredContext", functools.partial(DeferredContext, capacity=room))
    target, drafter = make_pair(tmp_path)
    settings = {**SETTINGS, "kv_cache_memory": kv_cache_memory}
    prompts = repeating_prompts(4, 160) + random_prompts(2, 160)
    recorded, held, prefills_held, held_in_place = {}, [], [], []
    for method in ("hybrid", "dflash"):
        llm = LLM(target, drafter, speculative_method=method, num_speculative_tokens=5, **settings)
        runner = llm.assembly.runner
        proposer = runner.drafter
        recorder = PositionRecorder(proposer.dflash if method == "hybrid" else proposer, runner.step_buffers,
                                    llm.engine)
        if method == "hybrid":
            proposer.dflash = recorder
            hold = proposer.deferred.hold

            def counting(context, owners, hold=hold):
                held.append(context.count)
                assert isinstance(context.rows, RowSelection) == (rows_form == "unpicked")
                hold(context, owners)
            proposer.deferred.hold = counting
            defers = proposer.defers_context

            def noting_prefills(step_rows, num_rows, *, prefill_only, defers=defers, proposer=proposer):
                had_room = proposer.deferred.has_room(num_rows)
                deferred = defers(step_rows, num_rows, prefill_only=prefill_only)
                prefills_held.append(prefill_only and deferred)
                held_in_place.append(deferred and not had_room)
                return deferred
            proposer.defers_context = noting_prefills
        else:
            runner.swap_drafter(recorder)
        try:
            first = outputs(llm, prompts)
            assert first == plain(target, prompts, GREEDY)
            continued = [prompt + out[:24] for prompt, out in zip(prompts, first)]
            assert outputs(llm, continued) == plain(target, continued, GREEDY)
            preempted = llm.engine.counters().num_preemptions
            if method == "hybrid":
                assert proposer.deferred.count == 0  # everything held went in before the pages went back
        finally:
            llm.close()
        recorded[method] = recorder.proposals
        assert (preempted > 0) == (kv_cache_memory == "256KiB"), preempted
    assert held, "no step's context was deferred: the test shows nothing"
    if room is None:
        assert any(prefills_held), "no prefill-only step's context was deferred"
    else:  # (a prompt's rows are more than the room: stored at once)
        assert any(held_in_place), "no step's rows were held in the place of rows stored to make room"
    common = recorded["hybrid"].keys() & recorded["dflash"].keys()
    continued_keys = {tuple(prompt) for prompt in continued}
    assert any(key[0] in continued_keys for key in common), "DFlash never drafted a continued prompt in both"
    for key in common:
        assert recorded["hybrid"][key] == recorded["dflash"][key], key


@pytest.mark.parametrize("method", ["dflash", "ngram", "hybrid"])
def test_the_counters_per_proposer_are_the_steps_each_proposer_drafted(tmp_path, method):
    """Each request's counters by proposer equal its per-step counts summed by who drafted each step
    (as the proposer named its rows), and add up to its totals; the engine's are the requests' sum."""
    target, drafter = make_pair(tmp_path)
    prompts = repeating_prompts(3, 160) + random_prompts(2, 160)
    llm = LLM(target, None if method == "ngram" else drafter, speculative_method=method,
              num_speculative_tokens=5, **SETTINGS)
    proposer, budget, drafted_by = llm.assembly.runner.drafter, llm.assembly.runner.draft_budget, {}
    if method != "dflash":
        propose = proposer.propose

        def noting(num_seqs, num_draft, columns):
            propose(num_seqs, num_draft, columns)
            for seq, source in zip(proposer.staged, proposer.sources):
                if budget.max_accepted(seq.num_computed, seq.num_remaining_tokens):  # else not a spec step
                    drafted_by.setdefault(seq.request_id, []).append(source)
        proposer.propose = noting
    try:
        params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, spec_decode_per_step=True)
        results = llm.generate(prompts, params)
        engine_stats = llm.stats
    finally:
        llm.close()
    expected_total = {}
    for result in results:
        stats = result.spec_decode
        sources = drafted_by.get(result.request_id, ["dflash"] * stats.num_drafts)
        assert len(sources) == stats.num_drafts
        expected = {}
        for source, accepted, verified in zip(sources, stats.per_step_accepted, stats.per_step_drafted):
            counts = expected.setdefault(source, [0, 0, 0])
            counts[0], counts[1], counts[2] = counts[0] + 1, counts[1] + verified, counts[2] + accepted
        got = {name: [c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens]
               for name, c in stats.by_proposer.items()}
        assert got == expected
        for name, counts in expected.items():
            expected_total[name] = [a + b for a, b in zip(expected_total.get(name, [0, 0, 0]), counts)]
    assert {name: [c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens]
            for name, c in engine_stats.by_proposer.items()} == expected_total
    if method == "hybrid":
        assert set(expected_total) == {"dflash", "ngram"}, "one proposer drafted all: it shows little"
    else:
        assert set(expected_total) == {method}


@pytest.mark.parametrize("settings,message", [
    (dict(speculative_method="ngram", with_drafter=True), "takes no drafter"),
    (dict(speculative_method="hybrid"), "needs a drafter"),
    (dict(speculative_method="dflash"), "needs a drafter"),
    (dict(speculative_method="ngram", prompt_lookup_min=4, prompt_lookup_max=2), "prompt_lookup_min 4"),
    (dict(speculative_method="beam"), "speculative_method"),
    (dict(num_speculative_tokens=3), "needs a drafter or speculative_method 'ngram'"),
])
def test_bad_proposer_settings_are_refused_in_one_line(tmp_path, settings, message):
    target, drafter = make_pair(tmp_path)
    settings = dict(settings)
    with_drafter = settings.pop("with_drafter", False)
    with pytest.raises(ValueError, match=message) as caught:
        LLM(target, drafter if with_drafter else None, **settings, **SETTINGS)
    assert "\n" not in str(caught.value)


def test_a_drafter_lost_while_held_rows_make_room_fails_no_request(tmp_path, monkeypatch):
    """A step whose rows do not fit the hold stores the held rows first; when the drafter is gone
    then, no request fails: their sequences go on without context (plainly, lossless) and the
    outputs equal plain greedy decoding. (The room, 40 rows, is filled by 7 lookup-only steps of six
    sequences and holds any one step's, as in the deferred-context test above.)"""
    monkeypatch.setattr(hybrid, "choose_step", scripted_choice(8))
    monkeypatch.setattr(hybrid, "DeferredContext", functools.partial(DeferredContext, capacity=40))
    target, drafter = make_pair(tmp_path)
    prompts = repeating_prompts(4, 160) + random_prompts(2, 160)
    llm = LLM(target, drafter, speculative_method="hybrid", num_speculative_tokens=5, **SETTINGS)
    proposer, lost = llm.assembly.runner.drafter, []
    store = proposer.dflash.store_context
    making_room = [False]

    def defers(step_rows, num_rows, *, prefill_only, defers=proposer.defers_context):
        making_room[0] = not proposer.deferred.has_room(num_rows)
        try:
            return defers(step_rows, num_rows, prefill_only=prefill_only)
        finally:
            making_room[0] = False

    def failing_store(num_rows):
        if making_room[0] and not lost:  # the first store made to make room: the drafter is gone
            lost.append(list(proposer.deferred.owners))
            raise DrafterUnavailable("the drafter actor died")
        store(num_rows)

    proposer.defers_context, proposer.dflash.store_context = defers, failing_store
    try:
        assert outputs(llm, prompts) == plain(target, prompts)
    finally:
        llm.close()
    assert lost, "no held rows' store was made to make room: the test shows nothing"
