"""`dflash serve`: the OpenAI-compatible server, as a Ray Serve application, in the foreground.

It prints one ready line (the URL and a curl example) once every replica is ready, and on Ctrl-C or
SIGTERM drains: new requests get 503, those in flight run for up to --drain-timeout seconds (a second
signal cuts that short), then what still runs is stopped with an error its client can read (503, or
an error event and [DONE] in a stream), and the Ray this command started stops; the exit status is
0. On a cluster it joined (--address) only its application is deleted.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading

from dflash_cli.flags import add_proposer_flags
from target_service.serving.spec_decode_metrics import SPEC_DECODE_METRICS_LEVELS


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "serve", help="serve the OpenAI-compatible HTTP API (Ray Serve)",
        description="Serve a target (default: the built-in demo pair) with its DFlash drafter over an "
                    "OpenAI-compatible HTTP API, as a Ray Serve application.",
    )
    parser.add_argument("--target", help="target checkpoint directory (default: the built-in demo pair)")
    parser.add_argument("--drafter", help="DFlash drafter directory ('none': plain decoding)")
    parser.add_argument("--host", default="127.0.0.1", help="HTTP address to bind (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port (default: 8000)")
    parser.add_argument("--admin-port", type=int, default=50051,
                        help="admin gRPC port (pool stats, health) of replica 0; replica i uses +i; "
                             "-1: off")
    parser.add_argument("--replicas", type=int, default=1, help="model replicas (default: 1)")
    parser.add_argument("--address", help="Ray cluster to join: its GCS host:port or ray://host:10001 "
                                          "(default: $RAY_ADDRESS, else a local Ray)")
    parser.add_argument("-k", "--num-speculative-tokens", type=int, help="drafts per step")
    add_proposer_flags(parser)
    parser.add_argument("--context-storage", choices=("paged", "dense"), default="paged")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
                        help="the target's K/V pages: the compute dtype (auto), or float8 e4m3 (fp8: about "
                             "twice the tokens per pool; outputs follow the fp8 cache)")
    parser.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when available)")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--kv-cache-memory", help="pool budget per replica, e.g. 512MiB")
    parser.add_argument("--max-num-batched-tokens", type=int,
                        help="query rows one step runs: prefill chunks plus verifies (default: 2048)")
    parser.add_argument("--max-prefill-tokens-with-decodes", type=int,
                        help="prompt tokens a step prefills while streams decode beside it: the longest "
                             "gap a long prompt puts in them (default, or 0: no cap: the step's budget)")
    parser.add_argument("--max-waiting", type=int, default=256, help="queued requests before 429")
    parser.add_argument("--drain-timeout", dest="drain_timeout_s", type=float, metavar="SECONDS",
                        help="on Ctrl-C or SIGTERM, how long requests in flight may run on before they "
                             "are stopped with an error (default: 30; a second signal stops at once)")
    parser.add_argument("--api-key-file", help="file holding the API key clients must send (default: "
                                               "$DFLASH_API_KEY holds the key itself; neither: no key)")
    parser.add_argument("--admin-token-file", help="file holding the admin gRPC bearer token")
    parser.add_argument("--served-model-name", help="the model name clients ask for")
    parser.add_argument("--compile-cache-dir", type=os.path.abspath, metavar="DIR",
                        help="Triton's compile cache for the replicas (their TRITON_CACHE_DIR): keep it "
                             "across restarts and start-up loads kernels instead of compiling them "
                             "(default: $TRITON_CACHE_DIR, else ~/.triton/cache)")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false",
                        help="read every step before queuing the next (default: the steady state's next "
                             "step is queued first)")
    parser.add_argument("--num-cpus-per-replica", type=float, default=1.0)
    parser.add_argument("--num-gpus-per-replica", type=float, default=None,
                        help="GPUs per replica (default: 1 on a GPU machine, else 0)")
    parser.add_argument("--replica-resources", metavar="JSON",
                        help="custom Ray resources a replica needs, e.g. '{\"dflash_gpu\": 1}' (default: "
                             "none); each replica's CPUs, GPUs and these sit on one node")
    parser.add_argument("--services", choices=("inprocess", "ray"), default="inprocess",
                        help="where a replica's engine runs: in the replica's process (default), or as "
                             "three Ray actors, pool, drafter and target, each its own process")
    parser.add_argument("--per-request-spec-decode-metrics", choices=SPEC_DECODE_METRICS_LEVELS,
                        help="vLLM's: each one-choice response gets a top-level metrics object with its "
                             "speculative-decoding stats (the stream: on its include_usage chunk); "
                             "detailed adds every step's counts (default: off, responses unchanged)")
    parser.set_defaults(func=run)


def serve_args(args: argparse.Namespace):
    from target_service.serving.serve_args import ServeArgs

    fields = {name: getattr(args, name) for name in ServeArgs.model_fields
              if getattr(args, name, None) is not None}
    if fields.get("admin_port") == -1:
        fields["admin_port"] = None
    if fields.get("max_prefill_tokens_with_decodes") == 0:
        fields["max_prefill_tokens_with_decodes"] = None
    if args.num_gpus_per_replica is None:
        import torch

        fields["num_gpus_per_replica"] = 1.0 if torch.cuda.is_available() and args.device != "cpu" else 0.0
    return ServeArgs(**fields)


def run(args: argparse.Namespace) -> int:
    from target_service.serving import deploy

    settings = serve_args(args)
    try:
        return _serve(deploy, settings)
    except deploy.ReplicaStartFailed as error:
        print(f"dflash serve: error: {error}", file=sys.stderr, flush=True)
        return 1


def _serve(deploy, settings) -> int:
    stop, hurry = threading.Event(), threading.Event()
    with deploy.serving(settings, hurry, say=lambda line: print(line, flush=True)) as url:
        # after Ray's start: its core worker installs a failure handler for SIGTERM that aborts
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: _on_signal(stop, hurry))
        example = json.dumps({"model": settings.model_name, "prompt": "def fibonacci(n):", "max_tokens": 32})
        print(f"dflash serve: ready at {url}/v1 (model {settings.model_name}, {settings.replicas} "
              f"replica(s)); try: curl {url}/v1/completions -H 'Content-Type: application/json' "
              f"-d '{example}'", flush=True)
        stop.wait()
        print(f"dflash serve: stopping; requests in flight may run for {settings.drain_timeout_s:g} s "
              "more (Ctrl-C again: stop them now)", flush=True)
    print("dflash serve: stopped", flush=True)
    return 0


def _on_signal(stop: threading.Event, hurry: threading.Event) -> None:
    """The first Ctrl-C or SIGTERM drains; the next one stops the requests still in flight at once."""
    if stop.is_set() and not hurry.is_set():
        print("dflash serve: stopping the requests in flight now", flush=True)
        hurry.set()
    stop.set()
