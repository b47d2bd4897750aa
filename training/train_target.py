"""`dflash train target`: a small Qwen3 LM trained from scratch on code, saved in HF layout.

corpus (default: this Python's standard library) -> hash split -> byte-level BPE -> token stream
-> random windows -> AdamW / cosine -> held-out loss -> config.json, generation_config.json,
tokenizer.json, sharded safetensors, and train_log.json beside them.
"""

from __future__ import annotations

import json
import logging
import math
import platform
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer

from foundation.byte_size import parse_byte_size
from foundation.checkpoint_config import TargetConfig
from foundation.device_name import resolve_device
from training.corpus import (
    encode_documents,
    load_documents,
    sample_windows,
    special_ids,
    split_documents,
    token_stream,
    train_tokenizer,
)
from training.dense_target import DenseQwen3, causal_lm_loss
from training.export import export_target, target_config_json
from training.loop import LoopSettings, autocast, train_loop
from training.optim import make_optimizer
from training.run_args import TrainTargetArgs

logger = logging.getLogger(__name__)

TRAIN_LOG = "train_log.json"


def _tokenizer(args: TrainTargetArgs, out: Path, train_docs) -> Tokenizer:
    """The given tokenizer, the one a resumed run already wrote, or a new one trained here."""
    existing = Path(args.tokenizer) if args.tokenizer else out / "tokenizer.json"
    if args.tokenizer or (args.resume and existing.is_file()):
        if not existing.is_file():
            raise ValueError(f"--tokenizer {existing}: no such file")
        return Tokenizer.from_file(str(existing))
    tokenizer = train_tokenizer(train_docs, args.vocab_size, sample_bytes=int(args.tokenizer_sample_mb * 1e6),
                                seed=args.seed)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    return tokenizer


@torch.no_grad()
def held_out_loss(model: DenseQwen3, stream: torch.Tensor, *, batches: int, batch_size: int, seq_len: int,
                  device: torch.device) -> float:
    """Mean next-token loss over fixed-seed windows of the held-out stream (same windows every time)."""
    generator = torch.Generator().manual_seed(1234)
    model.eval()
    losses = []
    for _ in range(batches):
        windows = sample_windows(stream, batch_size, seq_len + 1, generator).to(device)
        with autocast(device):
            losses.append(float(causal_lm_loss(model, windows)))
    return sum(losses) / len(losses)


def train_target(args: TrainTargetArgs) -> dict:
    """Run the whole command; return the summary also written to <out>/train_log.json."""
    started = time.monotonic()
    out, device = Path(args.out), resolve_device(args.device)
    torch.manual_seed(args.seed)
    train_docs, held_docs = split_documents(load_documents(args.corpus), args.held_out_percent)
    tokenizer = _tokenizer(args, out, train_docs)
    eos_id, _ = special_ids(tokenizer)
    train_stream = token_stream(encode_documents(tokenizer, train_docs), eos_id)
    held_stream = token_stream(encode_documents(tokenizer, held_docs), eos_id)
    logger.info("tokens: %d train (%d files), %d held-out (%d files)", train_stream.numel(), len(train_docs),
                held_stream.numel(), len(held_docs))
    config_json = target_config_json(
        vocab_size=tokenizer.get_vocab_size(), hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_layers=args.layers, num_heads=args.heads, num_kv_heads=args.kv_heads, head_dim=args.head_dim,
        max_position_embeddings=args.max_position_embeddings, rope_theta=10000.0, eos_token_id=eos_id,
        dtype=args.save_dtype,
    )
    model = DenseQwen3(TargetConfig.model_validate(config_json)).to(device)
    optimizer, schedule = make_optimizer(model, lr=args.lr, weight_decay=args.weight_decay,
                                         total_steps=args.steps, warmup_steps=args.warmup_steps,
                                         fused=device.type == "cuda")
    generator = torch.Generator().manual_seed(args.seed)
    train_on = train_stream

    def loss_fn(gen: torch.Generator):
        windows = sample_windows(train_on, args.batch_size, args.seq_len + 1, gen)
        windows = windows.to(device, non_blocking=True)
        return causal_lm_loss(model, windows), {}

    settings = LoopSettings(save_every=args.save_every, stop_after=args.stop_after, resume=args.resume,
                            time_budget=args.time_budget)
    run_args = args.model_dump(exclude={"device"})
    step, history, total = train_loop("train target", out, model, loss_fn, optimizer, schedule, generator,
                                      run_args, settings, device)
    summary = {"command": "train target", "args": run_args, "step": step, "total_steps": total,
               "finished": step >= total,
               "parameters": sum(p.numel() for p in model.parameters()), "device": _device_name(device),
               "python": platform.python_version(), "torch": torch.__version__,
               "train_tokens": train_stream.numel(), "held_out_tokens": held_stream.numel(),
               "train_files": len(train_docs), "held_out_files": len(held_docs),
               "epochs": round(step * args.batch_size * args.seq_len / train_stream.numel(), 3),
               "final_train_loss": history[-1]["loss"] if history else math.nan, "history": history}
    if step >= total:
        summary["held_out_loss"] = held_out_loss(model, held_stream, batches=args.eval_batches,
                                                 batch_size=args.batch_size, seq_len=args.seq_len,
                                                 device=device)
        logger.info("held-out loss %.4f (train %.4f)", summary["held_out_loss"], summary["final_train_loss"])
        export_target(out, model, config_json, tokenizer,
                      max_shard_bytes=parse_byte_size(args.max_shard_size))
    summary["wall_seconds"] = round(time.monotonic() - started, 1)
    (out / TRAIN_LOG).write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({torch.get_num_threads()} threads)"
