"""When a request ends: EOS, a stop token, a stop string, max_tokens or max_model_len."""

from __future__ import annotations

from target_service.engine.sequence import Sequence


class StopChecker:
    def __init__(self, eos_token_ids, tokenizer=None):
        self.eos_token_ids = frozenset(eos_token_ids)
        self.tokenizer = tokenizer

    def check(self, seq: Sequence, max_model_len: int) -> str | None:
        """The finish reason after seq's newest output token, or None to go on."""
        params, token = seq.params, seq.output_token_ids[-1]
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            return "stop"
        if params.stop and self.tokenizer is not None and self.stop_string_end(seq) is not None:
            return "stop"
        if len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= max_model_len:
            return "length"
        return None

    def stop_string_end(self, seq: Sequence) -> int | None:
        """Index where the output text must be cut (the start of the first stop string), if any."""
        text = self.decode(seq.output_token_ids)
        found = [text.find(stop) for stop in seq.params.stop if stop in text]
        return min(found) if found else None

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids) if self.tokenizer is not None else ""

    def output_text(self, seq: Sequence) -> str:
        """The text of a request's output: stop tokens dropped, cut before a stop string."""
        ids = seq.output_token_ids
        if seq.finish_reason == "stop" and ids and (ids[-1] in seq.params.stop_token_ids
                                                    or ids[-1] in self.eos_token_ids):
            ids = ids[:-1]
        text = self.decode(ids)
        if seq.params.stop and self.tokenizer is not None:
            cut = [text.find(stop) for stop in seq.params.stop if stop in text]
            if cut:
                text = text[: min(cut)]
        return text
