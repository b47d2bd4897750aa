"""`dflash train drafter`: a DFlash drafter for a frozen target, then its acceptance.

The recipe: docs/architecture.md section 7, "As trained".

target (HF layout, with tokenizer.json) -> corpus split -> the target's own continuations of train
prefixes through the engine + raw corpus windows -> per step: frozen target taps (teacher forcing),
random anchors, blocks, weighted CE -> DFlash layout -> acceptance on held-out prompts through the
engine (eval.json beside the weights).
"""

from __future__ import annotations

import json
import logging
import platform
import time
from pathlib import Path

import torch

from foundation.byte_size import parse_byte_size
from foundation.checkpoint_config import DrafterConfig
from target_service.runner.checkpoint import open_target_checkpoint
from training.anchors import build_blocks, default_gamma, sample_anchors, weighted_block_loss
from training.corpus import (
    MASK_TOKEN,
    encode_documents,
    held_out_prompts,
    load_documents,
    split_documents,
    token_stream,
)
from training.dense_drafter import DenseDFlashDrafter
from training.dense_target import DenseQwen3
from training.drafter_data import SequenceSet, build_generated_set, raw_windows
from training.evaluate import evaluate_pair
from training.export import drafter_config_json, export_drafter
from training.loop import LoopSettings, train_loop
from training.optim import make_optimizer
from training.run_args import TrainDrafterArgs
from training.state import CHECKPOINT_DIR
from training.train_target import _device_name, resolve_device

logger = logging.getLogger(__name__)

EVAL_FILE = "eval.json"
TRAIN_LOG = "train_log.json"


def parse_taps(text: str, num_target_layers: int, num_draft_layers: int) -> list[int]:
    """'auto' or a comma list. auto: max(3, draft layers) taps (at most every layer) spread evenly
    from layer 1 to the LAST layer: a small target keeps most of its next-token information in its
    last layers, which the release's rule (it stops at L-3, for 36-layer targets) would leave out.
    """
    if text == "auto":
        count = min(num_target_layers, max(3, num_draft_layers))
        if count == 1 or num_target_layers == 1:
            return [num_target_layers - 1]
        first = 1 if num_target_layers > count else 0
        span = num_target_layers - 1 - first
        return sorted({round(first + i * span / (count - 1)) for i in range(count)})
    try:
        taps = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--taps must be 'auto' or comma-separated layer ids, got {text!r}") from None
    bad = [i for i in taps if not 0 <= i < num_target_layers]
    if not taps or bad or len(set(taps)) != len(taps):
        raise ValueError(f"--taps {text!r}: need distinct layer ids in 0..{num_target_layers - 1}")
    return taps


def load_frozen_target(path: str, device: torch.device) -> tuple[DenseQwen3, object]:
    """The target as a dense, frozen DenseQwen3 (for teacher-forced taps), and its checkpoint."""
    checkpoint = open_target_checkpoint(path)
    if checkpoint.tokenizer is None:
        raise ValueError(f"{path}: the target has no tokenizer.json; drafter training reads text")
    model = DenseQwen3(checkpoint.config)
    state = dict(checkpoint.tensors.read(checkpoint.tensors.names()))
    if checkpoint.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    model.load_state_dict({name: tensor.float() for name, tensor in state.items()})
    model.requires_grad_(False)
    return model.to(device).eval(), checkpoint


def _mask_token(args: TrainDrafterArgs, checkpoint) -> int:
    mask = args.mask_token_id
    if mask is None:
        mask = checkpoint.tokenizer.token_to_id(MASK_TOKEN)
    if mask is None:
        raise ValueError(f"the target's tokenizer has no {MASK_TOKEN}; give --mask-token-id (a reserved row)")
    if mask >= checkpoint.config.vocab_size:
        raise ValueError(f"--mask-token-id {mask} is outside the target's vocabulary of "
                         f"{checkpoint.config.vocab_size}")
    return mask


def _generated(args: TrainDrafterArgs, target: DenseQwen3, stream: torch.Tensor, eos_id: int | None,
               pad_id: int) -> SequenceSet:
    """The target's continuations, made once and kept with the checkpoints (a resumed run reuses them)."""
    path = Path(args.out) / CHECKPOINT_DIR / "generated.pt"
    if args.resume and path.is_file():
        return SequenceSet.load(path)
    if not args.generated or not args.generated_fraction:
        return SequenceSet(torch.zeros(0, args.seq_len, dtype=torch.long), torch.zeros(0, dtype=torch.long),
                           torch.zeros(0, args.seq_len, dtype=torch.bool))
    data = build_generated_set(target, stream, count=args.generated, prompt_len=args.prompt_len,
                               gen_tokens=args.gen_tokens, seq_len=args.seq_len, pad_id=pad_id, eos_id=eos_id,
                               temperature=args.gen_temperature, seed=args.seed, batch=args.gen_batch)
    data.save(path)
    return data


def make_loss_fn(args: TrainDrafterArgs, target: DenseQwen3, drafter: DenseDFlashDrafter,
                 generated: SequenceSet, stream: torch.Tensor, *, mask_token_id: int, gamma: float,
                 device: torch.device):
    """loss_fn(generator) for the loop: a mixed batch, frozen-target taps, anchors, blocks, weighted CE."""
    num_generated = round(args.batch_size * args.generated_fraction) if len(generated) else 0
    taps_ids = drafter.config.target_layer_ids
    embed, lm_head = target.model.embed_tokens.weight, target.lm_head_weight

    def loss_fn(generator: torch.Generator):
        rows = [generated.rows(torch.randint(0, len(generated), (num_generated,), generator=generator))]
        if args.batch_size > num_generated:
            rows.append(raw_windows(stream, args.batch_size - num_generated, args.seq_len, generator))
        batch = SequenceSet.cat(rows)
        anchors, keep = sample_anchors(batch.lengths, batch.loss_mask, args.anchors, generator)
        batch = batch.to(device)
        blocks = build_blocks(batch.ids, batch.lengths, batch.loss_mask, anchors.to(device), keep.to(device),
                              block_size=args.block_size, mask_token_id=mask_token_id, gamma=gamma)
        with torch.no_grad():
            _, taps = target.hidden(batch.ids, taps_ids)
        logits = drafter(taps, blocks, embed, lm_head)
        loss, accuracy = weighted_block_loss(logits, blocks.labels, blocks.weights)
        return loss, {"accuracy": accuracy}

    return loss_fn


def train_drafter(args: TrainDrafterArgs) -> dict:
    """Run the whole command; return the summary also written to <out>/train_log.json."""
    started = time.monotonic()
    out, device = Path(args.out), resolve_device(args.device)
    torch.manual_seed(args.seed)
    target, checkpoint = load_frozen_target(args.target, device)
    config = checkpoint.config
    mask_token_id = _mask_token(args, checkpoint)
    taps = parse_taps(args.taps, config.num_hidden_layers, args.layers)
    eos_id = checkpoint.eos_token_ids[0] if checkpoint.eos_token_ids else None
    pad_id = mask_token_id if eos_id is None else eos_id  # separates documents and pads rows
    train_docs, held_docs = split_documents(load_documents(args.corpus), args.held_out_percent)
    out.mkdir(parents=True, exist_ok=True)  # only now: a run refused above leaves no empty folder behind
    stream = token_stream(encode_documents(checkpoint.tokenizer, train_docs), pad_id)
    generated = _generated(args, target, stream, eos_id, pad_id)
    config_json = drafter_config_json(
        json.loads((Path(args.target) / "config.json").read_text()), num_layers=args.layers,
        block_size=args.block_size, mask_token_id=mask_token_id, target_layer_ids=taps,
        intermediate_size=args.intermediate or config.intermediate_size, dtype=args.save_dtype)
    drafter = DenseDFlashDrafter(DrafterConfig.model_validate(config_json)).to(device)
    gamma = args.gamma or default_gamma(args.block_size)
    optimizer, schedule = make_optimizer(drafter, lr=args.lr, weight_decay=args.weight_decay,
                                         total_steps=args.steps, warmup_steps=args.warmup_steps,
                                         fused=device.type == "cuda")
    loss_fn = make_loss_fn(args, target, drafter, generated, stream, mask_token_id=mask_token_id, gamma=gamma,
                           device=device)
    settings = LoopSettings(save_every=args.save_every, stop_after=args.stop_after, resume=args.resume,
                            time_budget=args.time_budget)
    run_args = args.model_dump(exclude={"device", "eval", "eval_prompts", "eval_max_tokens", "eval_k",
                                        "eval_dtype", "timing_prompts"})
    step, history, total = train_loop("train drafter", out, drafter, loss_fn, optimizer, schedule,
                               torch.Generator().manual_seed(args.seed), run_args, settings, device)
    summary = {"command": "train drafter", "args": run_args, "step": step, "total_steps": total,
               "finished": step >= total,
               "target_layer_ids": taps, "mask_token_id": mask_token_id, "gamma": gamma,
               "parameters": sum(p.numel() for p in drafter.parameters()), "device": _device_name(device),
               "python": platform.python_version(), "torch": torch.__version__,
               "generated_sequences": len(generated), "history": history,
               "final_train_loss": history[-1]["loss"] if history else None}
    if step >= total:
        export_drafter(out, drafter, config_json, max_shard_bytes=parse_byte_size(args.max_shard_size))
        summary["train_seconds"] = round(time.monotonic() - started, 1)
        if args.eval:
            prompts = held_out_prompts(checkpoint.tokenizer, held_docs, args.eval_prompts, args.prompt_len,
                                       seed=args.seed)
            result = evaluate_pair(args.target, str(out), prompts, tokenizer=checkpoint.tokenizer,
                                   num_speculative_tokens=args.eval_k or args.block_size - 1,
                                   max_tokens=args.eval_max_tokens, device=str(device), dtype=args.eval_dtype,
                                   timing_prompts=args.timing_prompts)
            (out / EVAL_FILE).write_text(json.dumps(result, indent=2) + "\n")
            summary["eval"] = result
    summary["wall_seconds"] = round(time.monotonic() - started, 1)
    (out / TRAIN_LOG).write_text(json.dumps(summary, indent=2) + "\n")
    return summary
