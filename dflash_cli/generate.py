"""`dflash generate`: one prompt through the engine, printing the text and the acceptance stats."""

from __future__ import annotations

import argparse
import json
import time

from dflash_cli.flags import add_proposer_flags
from dflash_cli.main import CliError


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "generate", help="generate from one prompt (speculatively when a drafter is given)",
        description="Generate from one prompt with a target and, optionally, a DFlash drafter.",
    )
    parser.add_argument("prompt", nargs="?", help="prompt text (needs the checkpoint's tokenizer.json)")
    parser.add_argument("--prompt-ids", help="comma-separated prompt token ids, instead of text")
    parser.add_argument("--target", help="target checkpoint directory (default: the built-in demo pair)")
    parser.add_argument("--drafter", help="DFlash drafter checkpoint directory ('none': plain decoding; "
                                          "default: the demo drafter with the demo target, else none)")
    parser.add_argument("-k", "--num-speculative-tokens", type=int,
                        help="drafts per step (default: block_size - 1)")
    add_proposer_flags(parser)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--context-storage", choices=("paged", "dense"), default="paged")
    parser.add_argument("--kv-cache-memory", help="pool budget (e.g. 512MiB); default: device-dependent")
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"),
                        help="compute dtype (default: float32 on CPU, the checkpoint's dtype on a GPU)")
    parser.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
                        help="the target's K/V pages: the compute dtype (auto) or float8 e4m3 (fp8)")
    parser.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when available)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.set_defaults(func=run)


def _prompt(args: argparse.Namespace):
    if (args.prompt is None) == (args.prompt_ids is None):
        raise CliError("give either a PROMPT or --prompt-ids, not both and not neither")
    if args.prompt is not None:
        return args.prompt
    try:
        return [int(token) for token in args.prompt_ids.split(",") if token.strip()]
    except ValueError:
        raise CliError(f"--prompt-ids must be comma-separated integers, got {args.prompt_ids!r}") from None


def run(args: argparse.Namespace) -> int:
    from target_service.engine.sampling_params import SamplingParams
    from target_service.llm import LLM

    prompt = _prompt(args)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, ignore_eos=args.ignore_eos)
    llm = LLM(args.target, args.drafter, num_speculative_tokens=args.num_speculative_tokens,
              speculative_method=args.speculative_method, adaptive_speculation=args.adaptive_speculation,
              prompt_lookup_min=args.prompt_lookup_min,
              prompt_lookup_max=args.prompt_lookup_max,
              context_storage=args.context_storage, kv_cache_memory=args.kv_cache_memory,
              max_model_len=args.max_model_len, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
              device=args.device, max_num_seqs=1,
              seed=args.seed)
    try:
        started = time.perf_counter()
        output = llm.generate([prompt], params)[0]
        seconds = time.perf_counter() - started
    finally:
        llm.close()
    completion, stats = output.outputs[0], output.spec_decode
    result = {
        "text": completion.text, "token_ids": completion.token_ids, "finish_reason": completion.finish_reason,
        "num_prompt_tokens": len(output.prompt_token_ids), "seconds": round(seconds, 4),
        "tokens_per_second": round(len(completion.token_ids) / seconds, 2) if seconds else None,
        **stats.as_dict(),
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(completion.text if completion.text else " ".join(map(str, completion.token_ids)))
    print(f"\n[{len(completion.token_ids)} tokens in {seconds:.2f} s, finish: {completion.finish_reason}; "
          f"drafts {stats.num_drafts}, draft tokens {stats.num_draft_tokens}, accepted "
          f"{stats.num_accepted_tokens}, mean acceptance length {stats.mean_acceptance_length:.2f}]")
    return 0
