"""What a choice says besides the engine's text, in OpenAI's shapes: the echoed prompt and the
logprobs (completions' `CompletionLogprobs`, chat's `ChatLogprobs`), chunk by chunk.

A whole response is the concatenation of its stream's pieces (`ChoiceView.piece` over each engine
delta, `merge` to join them), so a stream and a response of the same request carry the same tokens,
logprobs and text offsets. Token texts are the tokenizer's decoding of each token alone, special
tokens included (vLLM's), or `token_id:N` without a tokenizer; a text offset is the sum of the texts
of the tokens before it (vLLM's count). A value JSON cannot carry (-inf: a token the processed
distribution filters out) is -9999.0, as OpenAI and vLLM send it.
"""

from __future__ import annotations

from dataclasses import dataclass

from target_service.engine.engine_client import RequestDelta
from target_service.engine.outputs import TokenLogprob
from target_service.serving.openai_responses import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    TopLogprob,
)
from target_service.serving.tool_formats import ToolFormat

LOWEST_LOGPROB = -9999.0


@dataclass(frozen=True)
class ChoiceAsks:
    """What a request's choices return besides their text."""

    num_logprobs: int | None = None  # the most likely tokens beside each token (None: no logprobs)
    echo: bool = False  # completions: the prompt's text (and logprobs) first
    echo_only: bool = False  # ... and nothing generated (max_tokens 0): the engine's one token is dropped
    chat: bool = False  # ChatLogprobs rather than CompletionLogprobs
    tools: ToolFormat | None = None  # chat with tools: calls in this format are read back


class TokenTexts:
    """Each token id's text alone, decoded once."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            if self.tokenizer is None:
                text = f"token_id:{token_id}"
            else:
                text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._texts[token_id] = text
        return text

    def prompt_text(self, token_ids: list[int]) -> str:
        """A prompt given as token ids, as text (empty without a tokenizer)."""
        return "" if self.tokenizer is None else self.tokenizer.decode(token_ids, skip_special_tokens=False)


@dataclass(frozen=True)
class Piece:
    """One chunk's share of a choice: its text and the logprobs of its tokens (None: not asked)."""

    text: str
    logprobs: CompletionLogprobs | ChatLogprobs | None
    num_tokens: int  # tokens the piece carries (the echoed prompt's included)


class ChoiceView:
    """One choice's engine deltas as pieces of its response: the prompt echoed into the first, a
    running text offset, logprobs in the endpoint's shape."""

    def __init__(self, asks: ChoiceAsks, texts: TokenTexts, prompt_token_ids: list[int], prompt_text: str):
        self.asks, self.texts = asks, texts
        self.prompt_token_ids, self.prompt_text = prompt_token_ids, prompt_text
        self.echoed = False
        self.offset = 0  # the next token's text offset

    def piece(self, delta: RequestDelta) -> Piece:
        text, token_ids = delta.text, list(delta.token_ids)
        entries = _padded(delta.logprobs, len(token_ids))
        if self.asks.echo_only:
            text, token_ids, entries = "", [], []
        if self.asks.echo and not self.echoed:
            self.echoed = True
            prompt = _padded(delta.prompt_logprobs, len(self.prompt_token_ids))
            text, token_ids, entries = (self.prompt_text + text, self.prompt_token_ids + token_ids,
                                        prompt + entries)
        if self.asks.num_logprobs is None:
            return Piece(text, None, len(token_ids))
        if self.asks.chat:
            return Piece(text, self._chat(entries), len(token_ids))
        return Piece(text, self._completion(token_ids, entries), len(token_ids))

    def _completion(self, token_ids: list[int], entries: list[TokenLogprob | None]) -> CompletionLogprobs:
        out, num_top = CompletionLogprobs(), self.asks.num_logprobs
        for token_id, entry in zip(token_ids, entries):
            token = self.texts(token_id)
            out.tokens.append(token)
            out.text_offset.append(self.offset)
            self.offset += len(token)
            if entry is None:  # the prompt's first token: nothing predicts it
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(_finite(entry.logprob))
            top = {self.texts(i): _finite(value)
                   for i, value in zip(entry.top_token_ids[:num_top], entry.top_logprobs[:num_top])}
            top.setdefault(token, _finite(entry.logprob))  # OpenAI's N + 1: the token itself too
            out.top_logprobs.append(top)
        return out

    def _chat(self, entries: list[TokenLogprob | None]) -> ChatLogprobs:
        num_top, content = self.asks.num_logprobs, []
        for entry in entries:
            if entry is None:
                continue
            top = zip(entry.top_token_ids[:num_top], entry.top_logprobs[:num_top])
            content.append(ChatTokenLogprob(**self._top(entry.token_id, entry.logprob).model_dump(),
                                            top_logprobs=[self._top(i, value) for i, value in top]))
        return ChatLogprobs(content=content)

    def _top(self, token_id: int, logprob: float) -> TopLogprob:
        token = self.texts(token_id)
        return TopLogprob(token=token, logprob=_finite(logprob), bytes=list(token.encode("utf-8", "replace")))


def merge(pieces: list[Piece]) -> Piece:
    """The pieces of one choice as one: texts joined, logprobs concatenated."""
    text = "".join(piece.text for piece in pieces)
    logprobs = None
    for piece in pieces:
        if piece.logprobs is not None:
            if logprobs is None:
                logprobs = piece.logprobs.model_copy(deep=True)
            else:
                logprobs.extend(piece.logprobs)
    return Piece(text, logprobs, sum(piece.num_tokens for piece in pieces))


def _padded(entries: list | None, count: int) -> list:
    """`count` entries: those given, None for any missing."""
    entries = list(entries or [])
    return entries + [None] * (count - len(entries))


def _finite(value: float) -> float:
    """A logprob JSON can carry: -inf (and NaN) become LOWEST_LOGPROB."""
    return value if value >= LOWEST_LOGPROB else LOWEST_LOGPROB
