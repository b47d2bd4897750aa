"""`dflash kvpool`: a standalone KV pool server (the gRPC control plane over one pool).

It sizes the pool from the two checkpoints' configs and a memory budget, creates the pool memory
(host memory in /dev/shm when there is no GPU), and serves Open / Reserve / Commit / Close,
GetLayout and PoolStats until SIGINT or SIGTERM. The control plane never hands out memory.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import shutil
import signal

from dflash_cli.flags import byte_size
from dflash_cli.main import CliError
from foundation.byte_size import format_bytes
from foundation.checkpoint_config import load_drafter_config, load_target_config
from foundation.device_name import check_device_name
from kvpool_service.geometry import DTYPE_NAMES, PoolLayout, PoolSpec

logger = logging.getLogger(__name__)


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "kvpool", help="run a standalone KV pool server (gRPC control plane)",
        description="Serve one paged KV pool (target K/V + draft context) over gRPC, on loopback "
                    "unless --host says otherwise.",
    )
    parser.add_argument("--target", required=True, help="target checkpoint directory or its config.json")
    parser.add_argument("--drafter", required=True, help="drafter checkpoint directory or its config.json")
    parser.add_argument("--memory", required=True, help="pool budget: bytes, 256MiB, 40GiB, 2e9, ...")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=50051, help="port (0: any free port; default 50051)")
    parser.add_argument("--token-file", help="file holding the bearer token clients must send (default: "
                                             "the token itself in $DFLASH_KVPOOL_TOKEN; neither: no auth)")
    parser.add_argument("--tokens-per-block", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="longest sequence (default: the target's max_position_embeddings)")
    parser.add_argument("--context-dtype", choices=sorted(DTYPE_NAMES), default=None,
                        help="dtype of the draft context (default: the target's dtype)")
    parser.add_argument("--watermark", type=float, default=0.01,
                        help="fraction of blocks admission keeps free for running sequences")
    parser.add_argument("--no-prefix-caching", action="store_true", help="turn the prefix cache off")
    parser.add_argument("--device", default=None, help="where the pool memory lives: cpu or cuda[:i] "
                                                       "(default: cuda when available)")
    parser.set_defaults(func=run)


def _check_args(args: argparse.Namespace) -> None:
    if not 0 <= args.port <= 65535:
        raise CliError(f"--port must be in 0..65535, got {args.port}")
    for flag, value in (("--max-num-seqs", args.max_num_seqs), ("--max-model-len", args.max_model_len)):
        if value is not None and value < 1:
            raise CliError(f"{flag} must be >= 1, got {value}")
    if not 0.0 <= args.watermark < 1.0:
        raise CliError(f"--watermark must be a fraction in [0, 1), got {args.watermark}")
    if args.device is not None:
        try:
            check_device_name(args.device)
        except ValueError as error:
            raise CliError(f"--device: {error}") from None


def build_pool(args: argparse.Namespace):
    """The pool of the flags (`kvpool_service.assembler`): the whole budget in blocks of target + draft
    bytes, its memory shared (/dev/shm without a GPU) so engines on this node can map it."""
    import torch

    from foundation.device_name import resolve_device
    from foundation.shm import SHM_DIR
    from kvpool_service.assembler import MIN_BLOCKS, PoolArgs
    from kvpool_service.assembler import build_pool as assemble_pool

    _check_args(args)
    target = load_target_config(args.target)
    drafter = load_drafter_config(args.drafter)
    spec = PoolSpec.from_configs(target, drafter, tokens_per_block=args.tokens_per_block,
                                 context_dtype=args.context_dtype)
    memory = byte_size("--memory", args.memory)
    num_blocks = spec.num_blocks(memory)
    if num_blocks < MIN_BLOCKS:
        held = "no block" if num_blocks == 0 else f"{num_blocks} block"
        raise CliError(f"--memory {args.memory} holds {held}: one block of {spec.tokens_per_block} tokens "
                       f"takes {format_bytes(spec.bytes_per_block)} and at least {MIN_BLOCKS} are needed")
    try:
        device = str(resolve_device(args.device))
    except ValueError as error:  # cuda without CUDA, or cuda:N past the last GPU
        raise CliError(f"--device: {error}") from None
    pool_args = PoolArgs(
        spec=spec, budget_bytes=memory, max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len or target.max_position_embeddings, watermark=args.watermark,
        enable_prefix_caching=not args.no_prefix_caching, device=device, share=True)
    try:
        pool = assemble_pool(pool_args)
    except OSError as error:  # /dev/shm cannot hold the pool (posix_fallocate: ENOSPC, EFBIG)
        if error.errno not in (errno.ENOSPC, errno.EFBIG):
            raise
        free = shutil.disk_usage(SHM_DIR).free
        raise CliError(f"--memory {args.memory} does not fit in {SHM_DIR}: {format_bytes(free)} free "
                       f"there; give less memory or mount a larger {SHM_DIR}") from None
    except torch.OutOfMemoryError:
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        raise CliError(f"--memory {args.memory} does not fit on {device}: {format_bytes(free)} free "
                       "there") from None
    logger.info("pool of %d blocks x %d tokens, %s on %s", pool.layout.num_blocks, spec.tokens_per_block,
                format_bytes(pool.memory.nbytes), pool.memory.device)
    return pool


def run(args: argparse.Namespace) -> int:
    from foundation.secret_file import POOL_TOKEN_ENV, load_secret

    token = load_secret(args.token_file, env=POOL_TOKEN_ENV)
    pool = build_pool(args)
    try:
        asyncio.run(_serve(pool.blocks, pool.layout, args.host, args.port, token))
    finally:
        pool.close()
    return 0


async def _serve(blocks, layout: PoolLayout, host: str, port: int, token: str | None) -> None:
    from kvpool_service.server import KVPoolServer

    try:
        server = await KVPoolServer.start(blocks, layout, host=host, port=port, token=token)
    except OSError:  # in use, or not ours to bind (below 1024); gRPC does not say which
        raise CliError(f"--port {port}: cannot listen on {host}:{port} (the port is in use, or --host "
                       f"{host} is no address of this machine)") from None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    # One line on stdout, so scripts started with --port 0 learn the port.
    print(f"kvpool listening on {server.address} (epoch {layout.epoch})", flush=True)
    await stop.wait()
    logger.info("kvpool shutting down")
    await server.stop(grace=2.0)
