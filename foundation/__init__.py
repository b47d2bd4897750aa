"""Foundations the three services share, below all of them: checkpoint configs, safetensors
reading, byte sizes, tensor checks, the cache-view type, shared memory (/dev/shm files and CUDA IPC).

Imports flow `kernels` <- `foundation` <- `kvpool_service` <- `drafter_service` <- `target_service`;
nothing here imports a service. Modules import torch, pydantic and safetensors only as they need.
"""
