"""The target service: the target model, scheduler, speculative engine, the offline API, and its assembler.

`from target_service import LLM, SamplingParams` (shaped like vLLM's offline API). Imported
lazily, so `dflash plan` and the admin commands start without loading torch.
"""

_EXPORTS = {
    "LLM": "target_service.llm",
    "SamplingParams": "target_service.engine.sampling_params",
    "RequestOutput": "target_service.engine.outputs",
    "CompletionOutput": "target_service.engine.outputs",
    "SpecDecodeStats": "target_service.engine.outputs",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'target_service' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)
