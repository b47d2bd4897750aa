"""Input checks shared by the paged kernels' entry points: one clear ValueError, before any launch.

Each check names the argument and what is allowed, so a caller sees at once which tensor is
wrong. Nothing here reads device memory (no `.item()`), so the checks run inside CUDA graph
capture and cost no synchronisation.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def is_power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


def check_rank(tensor, rank: int, name: str, layout: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor {layout}, got {type(tensor).__name__}")
    if tensor.dim() != rank:
        raise ValueError(f"{name} must be {layout} ({rank} dims), got shape {tuple(tensor.shape)}")


def check_same_device(device: torch.device, **tensors) -> None:
    for name, tensor in tensors.items():
        if tensor is not None and tensor.device != device:
            raise ValueError(f"{name} is on {tensor.device} but the other inputs are on {device}")


def check_power_of_two(value: int, name: str, minimum: int = 16) -> None:
    if not is_power_of_two(value) or value < minimum:
        raise ValueError(f"{name} must be a power of two >= {minimum}, got {value}")


def check_cache_pair(k_cache, v_cache) -> tuple[int, int, int]:
    """k_cache, v_cache [num_blocks, tokens_per_block, NKV, D], one dtype; returns (tpb, NKV, D)."""
    check_rank(k_cache, 4, "k_cache", "[num_blocks, tokens_per_block, NKV, D]")
    check_rank(v_cache, 4, "v_cache", "[num_blocks, tokens_per_block, NKV, D]")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ in shape")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache ({k_cache.dtype}) and v_cache ({v_cache.dtype}) differ in dtype")
    if k_cache.dtype not in (*ACTIVATION_DTYPES, FP8):
        raise ValueError(f"cache dtype must be bf16, fp16, fp32 or float8_e4m3fn, got {k_cache.dtype}")
    _, tokens_per_block, num_kv_heads, head_dim = k_cache.shape
    check_power_of_two(tokens_per_block, "tokens_per_block (k_cache.shape[1])")
    check_power_of_two(head_dim, "head dim D (k_cache.shape[3])")
    if num_kv_heads < 1:
        raise ValueError("k_cache must have at least one KV head")
    return tokens_per_block, num_kv_heads, head_dim


def check_scale(scale, name: str, device: torch.device) -> None:
    """A dequant scale: None, a Python number, or a 0-d float tensor on the inputs' device."""
    if scale is None or (isinstance(scale, (int, float)) and not isinstance(scale, bool)):
        if scale is not None and not scale > 0:
            raise ValueError(f"{name} must be positive, got {scale}")
        return
    if not isinstance(scale, torch.Tensor) or scale.dim() != 0 or not scale.dtype.is_floating_point:
        raise ValueError(f"{name} must be None, a Python float or a 0-d float tensor, got {scale!r}")
    check_same_device(device, **{name: scale})


def check_index_tensor(tensor, shape: tuple, name: str, layout: str, dtypes=(torch.int32,)) -> None:
    check_rank(tensor, len(shape), name, layout)
    if tensor.dtype not in dtypes:
        allowed = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{name} must be {allowed}, got {tensor.dtype}")
    for axis, want in enumerate(shape):
        if want is not None and tensor.shape[axis] != want:
            raise ValueError(f"{name} must be {layout} with dim {axis} = {want}, got {tuple(tensor.shape)}")


def scale_argument(scale):
    """(kernel argument, mode) for a scale: mode 0 none, 1 a float by value, 2 a 0-d tensor's pointer.

    A tensor scale is read on the device, never with `.item()`, so capture stays legal.
    """
    if scale is None:
        return 1.0, 0
    if isinstance(scale, torch.Tensor):
        return scale, 2
    return float(scale), 1
