"""GrammarVocabulary: the target's tokenizer as llguidance sees it, and the grammars compiled on it.

Built once per engine from the checkpoint's tokenizer.json (~25 ms for a 4k vocabulary, about a
second for 150k), it checks a request's grammar before anything is queued (`check`: one line
naming what is wrong) and makes each constrained sequence its `TokenConstraint`.

The model's vocabulary may be wider than the tokenizer's (embedding rows padded to a multiple of
64 or 128): tokens past the tokenizer's are never allowed under a grammar.
"""

from __future__ import annotations

import llguidance

from target_service.structured.constraint import TokenConstraint
from target_service.structured.params import StructuredOutputsParams

# what one grammar may cost: llguidance's defaults, with the per-token step bounded tighter than
# its 200k lexer fuel (~14 ms) so no constrained request can stall the step for long
PARSER_LIMITS = dict(step_lexer_fuel=100_000, max_grammar_size=200_000)


class GrammarVocabulary:
    def __init__(self, tokenizer, eos_token_ids, model_vocab_size: int):
        """tokenizer: a `tokenizers.Tokenizer`; eos_token_ids: what ends a request (a grammar that is
        complete allows only these). llguidance reads the tokenizer at the first structured request
        (an engine that never gets one never pays for it, and one whose tokenizer llguidance cannot
        read, a word-level one without a decoder, still serves everything else)."""
        self.model_vocab_size = model_vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._source = tokenizer
        self._tokenizer = None

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            try:
                tokenizer = llguidance.LLTokenizer(self._source.to_str(), eos_token=self.eos_token_ids)
            except ValueError as error:
                raise ValueError(f"structured outputs: this target's tokenizer cannot be read for grammars "
                                 f"({_one_line(error)})") from None
            if tokenizer.vocab_size > self.model_vocab_size:
                raise ValueError(f"structured outputs: the tokenizer has {tokenizer.vocab_size} tokens, the "
                                 f"model's vocabulary only {self.model_vocab_size}")
            self._tokenizer = tokenizer
        return self._tokenizer

    def check(self, params: StructuredOutputsParams) -> None:
        """Refuse a spec whose grammar does not compile against this tokenizer (ValueError naming
        the spec's kind), before anything is queued."""
        self._matcher(params)

    def constraint(self, params: StructuredOutputsParams) -> TokenConstraint:
        return TokenConstraint(self._matcher(params), self.model_vocab_size, self.eos_token_ids)

    def _matcher(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        """The spec compiled into a matcher at its start: building it is the compile, and its error
        state is the verdict (llguidance's constructor never raises on a bad grammar)."""
        try:
            grammar = params.grammar_text()
        except ValueError as error:
            raise ValueError(f"structured outputs: the {params.kind} is not valid: "
                             f"{_one_line(error)}") from None
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=_limits())
        if matcher.is_error():
            raise ValueError(f"structured outputs: the {params.kind} does not compile: "
                             f"{_one_line(matcher.get_error())}")
        return matcher


def _limits() -> llguidance.LLParserLimits:
    return llguidance.LLParserLimits(**PARSER_LIMITS)


def _one_line(error) -> str:
    return " ".join(str(error).split())[:300]
