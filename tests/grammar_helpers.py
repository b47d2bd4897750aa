"""What the structured-output tests share: a byte-level BPE tokenizer (every string has tokens, as a
real model's tokenizer does), a target and drafter over it, the specs with a check of their own
for each, and constrained greedy decoding done apart from the engine (HF transformers' logits, a
fresh llguidance matcher, argmax)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import llguidance
import torch
from engine_helpers import make_pair
from logprob_oracles import HFTarget

from target_service.structured.params import StructuredOutputsParams

EOS = 2  # the tiny checkpoints' eos_token_id
CORPUS = ['{"name": "Ada", "age": 36, "tags": ["x", "y"]}', '{"id": 7, "ok": true, "value": null}',
          "yes no maybe 123-4567 2026-12-03", "def f(x):\n    return x + 1\n", "[1, 2, 3] {} [] , : \" "]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
LARK = 'start: "(" item (", " item)* ")"\nitem: /[a-c]/ | /[0-9]/'
LARK_REGEX = r"\([a-c0-9](, [a-c0-9])*\)"  # LARK's language


def write_byte_tokenizer(directory: Path, vocab_size: int) -> None:
    """A byte-level BPE of `vocab_size` tokens (ids 0-2: <unk>, <s>, </s>) trained on CORPUS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(CORPUS * 20, trainer)
    assert tokenizer.get_vocab_size() <= vocab_size
    tokenizer.save(str(directory / "tokenizer.json"))


def grammar_pair(tmp_path, vocab_size: int = 320):
    target, drafter = make_pair(tmp_path, vocab_size=vocab_size)
    write_byte_tokenizer(Path(target), vocab_size)
    return target, drafter


SPECS = {
    "json": StructuredOutputsParams(json=SCHEMA),
    "json_object": StructuredOutputsParams(json_object=True),
    "regex": StructuredOutputsParams(regex=r"[0-9]{3}-[0-9]{4}"),
    "choice": StructuredOutputsParams(choice=["yes", "no", "maybe"]),
    "grammar": StructuredOutputsParams(grammar=LARK),
}


def assert_matches(spec: StructuredOutputsParams, text: str, finish_reason: str,
                   grammar_regex: str = LARK_REGEX) -> None:
    """The output is what its spec asks for, checked here without llguidance (json + jsonschema, re),
    once it stopped; a grammar's output against `grammar_regex`, the same language as a regex."""
    if finish_reason != "stop":
        return  # cut by max_tokens: a prefix, checked by the equality with the reference
    if spec.kind == "json":
        jsonschema.validate(json.loads(text), spec.json_schema)
    elif spec.kind == "json_object":
        assert isinstance(json.loads(text), dict), text
    elif spec.kind == "regex":
        assert re.fullmatch(spec.regex, text), text
    elif spec.kind == "choice":
        assert text in spec.choice, text
    else:
        assert re.fullmatch(grammar_regex, text), text


def reference_greedy(target_dir, prompt: list[int], spec: StructuredOutputsParams, max_tokens: int
                     ) -> list[int]:
    """Constrained greedy decoding, one token at a time, apart from the engine: the target's logits
    from HF transformers, the allowed tokens from a matcher of llguidance's own, the argmax of
    those; it ends at end-of-sequence, when the grammar is complete, or at max_tokens."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(target_dir) / "tokenizer.json"))
    lltok = llguidance.LLTokenizer(tokenizer.to_str(), eos_token=[EOS])
    matcher = llguidance.LLMatcher(lltok, spec.grammar_text(), log_level=0)
    model, out = HFTarget(target_dir), []
    while len(out) < max_tokens:
        logits = model.logits(prompt + out)[-1]
        bias = torch.frombuffer(bytearray(matcher.compute_logit_bias()), dtype=torch.uint8)
        allowed = torch.zeros_like(logits, dtype=torch.bool)
        allowed[: bias.numel()] = bias[: logits.numel()] > 0
        token = int(logits.masked_fill(~allowed, float("-inf")).argmax())
        out.append(token)
        assert matcher.consume_token(token)
        if token == EOS or matcher.is_stopped():
            break
    return out
