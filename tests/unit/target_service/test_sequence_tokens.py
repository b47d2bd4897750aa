"""Sequence.token_slice against slicing the joined token_ids, over every split of prompt and output."""

import random

from target_service.engine.sampling_params import SamplingParams
from target_service.engine.sequence import Sequence


def test_token_slice_is_token_ids_sliced():
    rng = random.Random()
    for _ in range(50):
        prompt = [rng.randrange(100) for _ in range(rng.randint(1, 12))]
        seq = Sequence(request_id="r", seq_id=0, prompt_token_ids=prompt,
                       params=SamplingParams(max_tokens=64), arrival=0.0)
        seq.output_token_ids.extend(rng.randrange(100) for _ in range(rng.randint(0, 12)))
        total = seq.num_tokens
        start = rng.randint(0, total)
        end = rng.randint(start, total)
        case = (prompt, seq.output_token_ids, start, end)
        assert seq.token_slice(start, end) == seq.token_ids[start:end], case
