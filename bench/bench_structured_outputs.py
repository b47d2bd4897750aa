"""What structured outputs cost, and why llguidance: grammar masks per token against xgrammar, and the
engine's tok/s and acceptance with and without a JSON schema, plain and DFlash, on the demo pair.

    python -m bench.bench_structured_outputs [--rounds 3] [--max-tokens 96] [--prompts 6]
        [--mask-tokens 200] [--device cpu] [--dtype float32] [--out bench/results/structured_outputs_cpu.md]

Masks: the demo target's tokenizer (byte-level BPE, 4,096 tokens) and one of 32,000 trained here on
this Python's standard library (the mask's cost grows with the vocabulary). For each library and
schema: the compile time, then a walk of `--mask-tokens` tokens, each the first allowed token in a
seeded random order, timing the mask of every step (median and p99); then the rollback of the whole
walk. xgrammar is measured only where it is importable (it is not a dependency: install it beside
the project to compare; its transformers and tvm-ffi requirements are why it is not one).

Engine: greedy, `--prompts` held-out code prompts in one batch, each mode (plain / DFlash x free /
JSON schema) back to back per round, after one warm-up round; tok/s of this process's CPU time on
the CPU (the other cores' work is not the engine's), of wall time on a GPU, median over rounds
(min-max), and DFlash's mean acceptance length. Writes one markdown file with the raw record as
a JSON block at its end.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer

from dflash_cli.bench.serve_report import client_machine
from target_service.assembly.demo import demo_drafter_path, demo_target_path
from target_service.engine.sampling_params import SamplingParams
from target_service.llm import LLM
from target_service.runner.checkpoint import open_target_checkpoint
from target_service.structured.params import JSON_OPTIONS, StructuredOutputsParams
from training.corpus import held_out_prompts, load_documents, split_documents

RESULTS = Path(__file__).resolve().parent / "results"
SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "args", "returns", "pure"],
          "properties": {"name": {"type": "string", "maxLength": 24},
                         "args": {"type": "array", "maxItems": 4,
                                  "items": {"type": "string", "maxLength": 12}},
                         "returns": {"enum": ["int", "str", "list", "dict", "None"]},
                         "pure": {"type": "boolean"}}}
SCHEMAS = {"function signature": SCHEMA, "any JSON object": {"type": "object"}}


# ---- masks ----------------------------------------------------------------------------------------

def big_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level BPE of `vocab_size` tokens trained on this Python's standard library."""
    import sysconfig

    from tokenizers import decoders, models, pre_tokenizers, trainers

    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train([str(file) for file in files], trainer)
    return tokenizer


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer: Tokenizer, eos: int):
        import llguidance
        self.lib, self.tokenizer = llguidance, llguidance.LLTokenizer(tokenizer.to_str(), eos_token=[eos])

    def matcher(self, schema: dict):
        grammar = self.lib.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        return self.lib.LLMatcher(self.tokenizer, grammar, log_level=0)

    def allowed(self, matcher) -> set[int]:
        bits = matcher.compute_bitmask()
        return {i for i in range(len(bits) * 8) if bits[i >> 3] >> (i & 7) & 1}

    def mask(self, matcher) -> None:
        matcher.compute_bitmask()

    def accept(self, matcher, token: int) -> None:
        assert matcher.consume_token(token), matcher.get_error()

    def rollback(self, matcher, count: int) -> None:
        matcher.rollback(count)


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer: Tokenizer, eos: int):
        import xgrammar

        vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
        info = xgrammar.TokenizerInfo([token for token, _ in vocab], vocab_type=xgrammar.VocabType.BYTE_LEVEL,
                                      stop_token_ids=[eos])
        self.lib, self.compiler, self.size = xgrammar, xgrammar.GrammarCompiler(info), len(vocab)
        self.bitmask = xgrammar.allocate_token_bitmask(1, len(vocab))

    def matcher(self, schema: dict):
        compiled = self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                     separators=(", ", ": "))
        return self.lib.GrammarMatcher(compiled, max_rollback_tokens=4096)

    def allowed(self, matcher) -> set[int]:
        matcher.fill_next_token_bitmask(self.bitmask)
        words = self.bitmask[0].tolist()
        return {i for i in range(self.size) if words[i >> 5] >> (i & 31) & 1}

    def mask(self, matcher) -> None:
        matcher.fill_next_token_bitmask(self.bitmask)

    def accept(self, matcher, token: int) -> None:
        assert matcher.accept_token(token)

    def rollback(self, matcher, count: int) -> None:
        matcher.rollback(count)


def libraries(tokenizer: Tokenizer, eos: int) -> list:
    found = [Llguidance(tokenizer, eos)]
    with contextlib.suppress(ImportError):  # xgrammar is not a dependency
        found.append(Xgrammar(tokenizer, eos))
    return found


def walk(library, schema: dict, steps: int, seed: int, eos: int) -> dict:
    """Compile, then up to `steps` tokens: each step's mask timed, the next token the first allowed
    one in a seeded order other than end-of-sequence (the walk ends where only that is left); then
    the whole walk rolled back."""
    rng = random.Random(seed)
    started = time.perf_counter()
    matcher = library.matcher(schema)
    compile_ms = (time.perf_counter() - started) * 1e3
    mask_us, taken = [], 0
    for _ in range(steps):
        started = time.perf_counter()
        library.mask(matcher)
        mask_us.append((time.perf_counter() - started) * 1e6)
        allowed = sorted(library.allowed(matcher) - {eos})
        rng.shuffle(allowed)
        if not allowed:
            break
        library.accept(matcher, allowed[0])
        taken += 1
    started = time.perf_counter()
    library.rollback(matcher, taken)
    rollback_us = (time.perf_counter() - started) * 1e6
    ordered = sorted(mask_us)
    return {"compile_ms": compile_ms, "mask_us_median": statistics.median(mask_us),
            "mask_us_p99": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], "tokens": taken,
            "rollback_us": rollback_us}


def mask_record(steps: int) -> list[dict]:
    demo = open_target_checkpoint(demo_target_path())
    tokenizers = {"demo (4,096)": (demo.tokenizer, min(demo.eos_token_ids)), "stdlib BPE (32,000)":
                  (big_tokenizer(32_000), 0)}
    rows = []
    for vocab, (tokenizer, eos) in tokenizers.items():
        for library in libraries(tokenizer, eos):
            for schema_name, schema in SCHEMAS.items():
                rows.append({"vocabulary": vocab, "library": library.name, "schema": schema_name,
                             **walk(library, schema, steps, seed=len(rows), eos=eos)})
    return rows


# ---- the engine -----------------------------------------------------------------------------------

def engine_record(args) -> dict:
    settings = dict(device=args.device, dtype=args.dtype, max_model_len=512, max_num_seqs=args.prompts,
                    kv_cache_memory="256MiB" if args.device == "cpu" else "4GiB")
    clock = time.process_time if args.device == "cpu" else time.perf_counter
    engines = {"plain": LLM(str(demo_target_path()), "none", **settings),
               "dflash": LLM(str(demo_target_path()), str(demo_drafter_path()), **settings)}
    tokenizer = open_target_checkpoint(demo_target_path()).tokenizer
    _, held = split_documents(load_documents(None), 5.0)  # the demo pair's own held-out split
    texts = held_out_prompts(tokenizer, held, args.prompts, 48, seed=1)
    spec = StructuredOutputsParams(json=SCHEMA)
    kinds = {"free": SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True),
             "JSON schema": SamplingParams(max_tokens=args.max_tokens, temperature=0,
                                           structured_outputs=spec)}
    runs: dict[str, list[float]] = {}
    acceptance, tokens = {}, {}
    for round_number in range(args.rounds + 1):
        for engine_name, llm in engines.items():
            for kind, params in kinds.items():
                started = clock()
                outputs = llm.generate(texts, params)
                seconds = clock() - started
                count = sum(len(out.outputs[0].token_ids) for out in outputs)
                key = f"{engine_name} / {kind}"
                if round_number == 0:  # the warm-up round: counted, not timed
                    drafts = sum(out.spec_decode.num_drafts for out in outputs)
                    accepted = sum(out.spec_decode.num_accepted_tokens for out in outputs)
                    acceptance[key] = 1 + accepted / drafts if drafts else None
                    tokens[key] = count
                    if kind == "JSON schema":
                        for out in outputs:
                            if out.outputs[0].finish_reason == "stop":
                                json.loads(out.outputs[0].text)  # the answer is the schema's JSON
                    continue
                runs.setdefault(key, []).append(count / seconds)
    for llm in engines.values():
        llm.close()
    return {"tok_s": runs, "acceptance": acceptance, "tokens": tokens}


# ---- the report -----------------------------------------------------------------------------------

def report(record: dict) -> str:
    lines = [
        "# Structured outputs: grammar masks, and the engine with and without a schema",
        "",
        f"- command: `{record['command']}`",
        f"- device: {record['machine']}",
        f"- commit {record['commit']}, {record['date']}; the run took {record['seconds']:.0f} s of wall time",
        "",
        "## Masks per token (JSON schemas, no free whitespace)",
        "",
        "| vocabulary | library | schema | compile ms | mask us, median | mask us, p99 | tokens walked | "
        "rollback of the walk, us |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in record["masks"]:
        lines.append(f"| {row['vocabulary']} | {row['library']} | {row['schema']} | "
                     f"{row['compile_ms']:.1f} | {row['mask_us_median']:.0f} | {row['mask_us_p99']:.0f} | "
                     f"{row['tokens']} | {row['rollback_us']:.0f} |")
    engine = record["engine"]
    where = f"{record['dtype']} on {record['device']}"
    lines += ["", f"## The engine, demo pair, one batch, greedy ({where})", "",
              "| engine / output | tok/s (min-max) | mean acceptance length | tokens |",
              "| --- | --- | --- | --- |"]
    for key, speeds in engine["tok_s"].items():
        accepted = engine["acceptance"][key]
        lines.append(f"| {key} | {statistics.median(speeds):.0f} ({min(speeds):.0f}-{max(speeds):.0f}) | "
                     f"{'-' if accepted is None else f'{accepted:.2f}'} | {engine['tokens'][key]} |")
    lines += ["", "```json", json.dumps(record, indent=1), "```", ""]
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--mask-tokens", type=int, default=200)
    parser.add_argument("--device", default=None, help="default: cuda where there is one, else cpu")
    parser.add_argument("--dtype", default=None, help="default: float32 on the CPU, else bfloat16")
    parser.add_argument("--out", type=Path, default=RESULTS / "structured_outputs_cpu.md")
    args = parser.parse_args(argv)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    started = time.time()
    record = {"masks": mask_record(args.mask_tokens), "engine": engine_record(args)}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    record.update(command=" ".join(["python -m bench.bench_structured_outputs", *(argv or sys.argv[1:])]),
                  machine=client_machine(), commit=commit, dtype=args.dtype,
                  device=("CPU" if args.device == "cpu" else torch.cuda.get_device_name()),
                  date=datetime.date.today().isoformat(),
                  seconds=time.time() - started)
    args.out.write_text(report(record))
    print(args.out.read_text())


if __name__ == "__main__":
    main()
