"""The runner's logprobs over hand-made logits: which rows a step plans (`plan_logprob_rows`, from the
scheduled layout), and what `gather_logprobs` returns for them, against oracles written here: raw is
log_softmax of the logits, processed the log of the temperature-scaled, top-k and top-p filtered
distribution computed by sorting; the top N come most likely first, N of them; the token of a step
row is the step's own choice, that of a prompt row the next prompt token."""

from __future__ import annotations

import math

import pytest
import torch
from logprob_oracles import processed_oracle

from target_service.engine.sampling_params import SamplingParams
from target_service.engine.scheduler_output import DecodeWork, PrefillChunk, SchedulerOutput
from target_service.engine.sequence import Sequence
from target_service.runner.logprobs import STEP_TOKEN, LogprobRows, gather_logprobs, plan_logprob_rows
from target_service.runner.sampling import filter_logits, filtered_logprobs
from target_service.runner.step_layout import scheduled_layout

VOCAB = 50


@pytest.fixture
def seed():
    value = int(torch.randint(0, 2**31, ()).item())
    torch.manual_seed(value)
    print(f"seed {value}")  # shown on failure
    return value


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7, top_k=10, top_p=0.8),
    SamplingParams(temperature=1.3, top_p=0.5),
    SamplingParams(temperature=0.5, top_k=3),
    SamplingParams(temperature=1.0),
])
def test_processed_logprobs_are_the_log_of_the_samplers_filtered_distribution(seed, params):
    logits = torch.randn(6, VOCAB) * 3
    got = filtered_logprobs(logits, params)
    expected = processed_oracle(logits, params)
    assert torch.equal(got.isinf(), expected.isinf())
    finite = ~expected.isinf()
    assert torch.allclose(got[finite].double(), expected[finite], atol=1e-5)
    assert torch.allclose(got.exp(), filter_logits(logits, params), atol=1e-6)  # the sampler's own


def test_processed_logprobs_of_a_greedy_request_are_one_hot():
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 3.0, -1.0]])
    got = filtered_logprobs(logits, SamplingParams(temperature=0))
    assert got[0].tolist() == [-math.inf, 0.0, -math.inf]
    assert torch.allclose(got[1, :2], torch.full((2,), -math.log(2)))  # a tie shares the mass
    assert got[1, 2] == -math.inf


def read_back(rows: LogprobRows, logits, targets) -> dict:
    return gather_logprobs(logits, targets, rows).read()


def test_raw_rows_are_log_softmax_with_the_top_n_most_likely_first(seed):
    logits = torch.randn(5, VOCAB)
    targets = torch.randint(0, VOCAB, (5,))
    rows = LogprobRows()
    rows.add((0, "output"), range(1, 4), [STEP_TOKEN] * 3, 4)
    rows.add((1, "output"), range(4, 5), [STEP_TOKEN], 0)
    rows.add((1, "prompt"), range(0, 1), [7], 2)
    rows.groups.append((0, len(rows.rows), None))
    out = read_back(rows, logits, targets)
    expected = torch.log_softmax(logits.double(), dim=-1)
    for key, logit_rows, tokens, num_top in [((0, "output"), [1, 2, 3], targets[1:4].tolist(), 4),
                                             ((1, "output"), [4], [int(targets[4])], 0),
                                             ((1, "prompt"), [0], [7], 2)]:
        assert len(out[key]) == len(logit_rows)
        for entry, row, token in zip(out[key], logit_rows, tokens):
            assert entry.token_id == token
            assert entry.logprob == pytest.approx(float(expected[row, token]), abs=1e-5)
            top = expected[row].topk(num_top)
            assert list(entry.top_token_ids) == top.indices.tolist() and len(entry.top_logprobs) == num_top
            assert list(entry.top_logprobs) == sorted(entry.top_logprobs, reverse=True)
            assert entry.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-5)


def test_a_greedy_tokens_logprob_equals_its_top_value_exactly(seed):
    """lm-evaluation-harness tells a greedy continuation by `token_logprob == max(top_logprobs)`.
    bf16 logits tie often at this vocabulary, and argmax and topk may break a tie differently, so the
    ids are checked against the set of tokens that share the top value, not against each other."""
    logits = torch.randn(4, VOCAB).to(torch.bfloat16)
    rows = LogprobRows()
    rows.add((0, "output"), range(4), [STEP_TOKEN] * 4, 1)
    rows.groups.append((0, 4, None))
    entries = read_back(rows, logits, logits.argmax(dim=-1))[(0, "output")]
    for row, entry in zip(logits, entries):
        tied = set((row == row.max()).nonzero().flatten().tolist())
        assert entry.logprob == entry.top_logprobs[0]
        assert entry.token_id in tied and entry.top_token_ids[0] in tied


def seq(seq_id: int, params: SamplingParams, prompt: list[int], outputs=()) -> Sequence:
    s = Sequence(f"r{seq_id}", seq_id, prompt, params, seq_id)
    s.output_token_ids = list(outputs)
    s.block_table = [seq_id]
    return s


def test_a_step_plans_rows_only_for_the_requests_that_ask_and_groups_the_processed_apart():
    raw, plain = SamplingParams(logprobs=2), SamplingParams()
    processed = SamplingParams(temperature=0.5, logprobs=1, logprobs_mode="processed")
    decoding = seq(0, raw, [3, 4], outputs=[9])
    decoding.num_computed = 2
    quiet = seq(1, plain, [3, 4], outputs=[9])
    quiet.num_computed = 2
    echoed = seq(2, SamplingParams(prompt_logprobs=3), [5, 6, 7, 8])
    fresh = seq(3, processed, [5, 6])
    plan = SchedulerOutput(decodes=[DecodeWork(decoding, 3, 3), DecodeWork(quiet, 3, 3)],
                           prefills=[PrefillChunk.next_of(echoed, 16), PrefillChunk.next_of(fresh, 16)])
    assert plan.prefills[0].prompt_logprob_positions == range(0, 3)
    _, rows, _ = scheduled_layout(plan, [3, 3], [3, 3], taps=False, width=3)
    assert rows[2].prompt == slice(8, 11) and rows[2].logits == slice(11, 12)  # 3 prompt rows, then the token
    planned = plan_logprob_rows(plan, rows)
    assert planned.spans == {(0, "output"): (0, 4, 2), (2, "prompt"): (4, 7, 3), (3, "output"): (7, 8, 1)}
    assert planned.rows == [0, 1, 2, 3, 8, 9, 10, 12]
    assert planned.tokens == [STEP_TOKEN] * 4 + [6, 7, 8] + [STEP_TOKEN]
    assert planned.groups == [(0, 7, None), (7, 8, processed)]
    assert plan_logprob_rows(SchedulerOutput(decodes=[DecodeWork(quiet, 3, 3)]), rows) is None


def test_a_prefix_cache_hit_is_replayed_for_its_logits_and_stores_nothing():
    """A prompt-logprob request whose first 16 positions are cached starts at 0: those rows run for
    their logits with PAD_SLOT, the rest are stored."""
    from target_service.runner.forward_batch import pack

    echoed = seq(0, SamplingParams(prompt_logprobs=0), list(range(3, 23)))
    echoed.num_computed = echoed.num_cached_tokens = 16
    echoed.block_table = [4, 5]
    chunk = PrefillChunk.next_of(echoed, 64)
    assert (chunk.start, chunk.num_tokens, chunk.num_replayed) == (0, 20, 16)
    chunks, rows, _ = scheduled_layout(SchedulerOutput(prefills=[chunk]), [], [], taps=False, width=0)
    batch = pack(chunks, 16, "cpu")
    assert batch.slot_mapping.tolist() == [-1] * 16 + [80, 81, 82, 83]
    assert batch.logits_indices.tolist() == list(range(20))  # 19 prompt rows and the first token's
    assert rows[0].prompt == slice(0, 19) and rows[0].logits == slice(19, 20)


@pytest.mark.parametrize(("num_cached", "start", "replayed"), [(32, 19, 13), (16, 16, 0), (0, 0, 0)])
def test_a_preempted_request_resumes_its_prompt_logprobs_where_they_stopped(num_cached, start, replayed):
    """Prompt logprobs known for tokens 0..19 (19 of them computed) when the request was preempted:
    recomputed from a prefix hit of `num_cached` tokens, it replays from position 19 (the first whose
    logits are missing) when the hit reaches past it, and otherwise recomputes from the hit as usual;
    either way only positions 19.. give prompt logprobs."""
    echoed = seq(0, SamplingParams(prompt_logprobs=0), list(range(3, 43)))
    echoed.prompt_logprobs += [None] * 19  # stand-ins for tokens 1..19's
    echoed.reset_for_recompute()
    assert len(echoed.prompt_logprobs) == 20  # kept through the preemption
    echoed.num_computed = num_cached
    chunk = PrefillChunk.next_of(echoed, 64)
    assert (chunk.start, chunk.num_replayed) == (start, replayed)
    assert chunk.prompt_logprob_positions == range(19, 39) and chunk.is_last
