"""`LLM`: the offline API, shaped like vLLM's (`LLM(...).generate(prompts, params)`)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from typing import Literal

from target_service.assembly.demo import resolve_pair
from target_service.assembly.engine_args import DEFAULT_PREFILL_WITH_DECODES, engine_args
from target_service.assembly.in_process import build_engine
from target_service.engine.outputs import CompletionOutput, RequestOutput, SpecDecodeStats
from target_service.engine.sampling_params import SamplingParams
from target_service.engine.sequence import Sequence


class LLM:
    """A target (and optionally a DFlash drafter) served in this process.

    With no target it serves the built-in demo pair (`target_service.assembly.demo`), speculatively unless
    drafter="none". With a target but no drafter (or drafter="none") it decodes plainly.
    `context_storage="dense"` reserves the draft context up front per sequence (the baseline) instead of
    paging it in the pool.

    `services="inprocess"` (the default) assembles the pool, drafter and target in this process;
    `services="ray"` runs them as three Ray actors (`target_service.assembly.ray_services`: a local Ray on
    loopback, or the cluster at `address` / RAY_ADDRESS) with the same outputs. `engine` is the
    in-process engine, None with Ray.
    """

    def __init__(self, target: str | None = None, drafter: str | None = None, *,
                 num_speculative_tokens: int | None = None, speculative_method: str | None = None,
                 adaptive_speculation: bool | None = None,
                 prompt_lookup_min: int = 1, prompt_lookup_max: int = 3,
                 context_storage: str = "paged", dtype: str | None = None, kv_cache_dtype: str = "auto",
                 device: str | None = None,
                 max_model_len: int | None = None, max_num_seqs: int = 256, kv_cache_memory=None,
                 gpu_memory_utilization: float = 0.9, tokens_per_block: int = 32,
                 enable_prefix_caching: bool = True, seed: int | None = None,
                 max_num_batched_tokens: int = 2048,
                 max_prefill_tokens_with_decodes: int | None = DEFAULT_PREFILL_WITH_DECODES,
                 enforce_eager: bool = False,
                 cuda_graph_sizes: list[int] | None = None, async_scheduling: bool = True,
                 services: Literal["inprocess", "ray"] = "inprocess", address: str | None = None):
        if services not in ("inprocess", "ray"):
            raise ValueError(f"services must be 'inprocess' or 'ray', got {services!r}")
        target, drafter = resolve_pair(target, drafter, speculative_method)
        self.args = engine_args(
            target=target, drafter=drafter,
            num_speculative_tokens=num_speculative_tokens, speculative_method=speculative_method,
            adaptive_speculation=adaptive_speculation,
            prompt_lookup_min=prompt_lookup_min, prompt_lookup_max=prompt_lookup_max,
            context_storage=context_storage, dtype=dtype,
            kv_cache_dtype=kv_cache_dtype, device=device, max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            kv_cache_memory=kv_cache_memory, gpu_memory_utilization=gpu_memory_utilization,
            tokens_per_block=tokens_per_block, enable_prefix_caching=enable_prefix_caching, seed=seed,
            max_num_batched_tokens=max_num_batched_tokens,
            max_prefill_tokens_with_decodes=max_prefill_tokens_with_decodes, enforce_eager=enforce_eager,
            cuda_graph_sizes=cuda_graph_sizes, async_scheduling=async_scheduling,
        )
        self.services = services
        self._ids = itertools.count()
        if services == "ray":
            from target_service.assembly.ray_services import RayServices
            from target_service.runner.checkpoint import open_target_checkpoint

            self.tokenizer = open_target_checkpoint(target).tokenizer
            self.engine = None
            self.assembly = RayServices(self.args, address=address).start()
        else:
            self.assembly = build_engine(self.args)
            self.engine, self.tokenizer = self.assembly.engine, self.assembly.tokenizer

    @property
    def stats(self) -> SpecDecodeStats:
        """Engine-wide speculative counters (num_drafts, ..., accepted per position)."""
        return self.assembly.stats() if self.engine is None else self.engine.stats

    def generate(self, prompts, params: SamplingParams | Seq[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Run prompts (strings, or lists of token ids) to completion; outputs in prompt order."""
        prompts = self._as_list(prompts)
        params = self._params_for(prompts, params)
        encoded = [self._encode(prompt) for prompt in prompts]
        if self.engine is None:
            results = self.assembly.generate(encoded, params)
            return [self._result_output(prompt, ids, result)
                    for prompt, ids, result in zip(prompts, encoded, results)]
        for ids, p in zip(encoded, params):  # refuse the whole call before anything runs
            self.engine.check_request(ids, p)
        seqs = [self.engine.add_request(f"req-{next(self._ids)}", ids, p) for ids, p in zip(encoded, params)]
        while self.engine.has_unfinished:
            self.engine.step()
        outputs = [self._output(prompt, seq) for prompt, seq in zip(prompts, seqs)]
        for seq in seqs:
            self.engine.release(seq.request_id)
        return outputs

    def close(self) -> None:
        self.assembly.close()

    # ---- helpers --------------------------------------------------------------------------------

    @staticmethod
    def _as_list(prompts) -> list:
        single_ids = isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        if isinstance(prompts, str) or single_ids:
            return [prompts]
        prompts = list(prompts)
        if not prompts:
            raise ValueError("generate needs at least one prompt")
        return prompts

    @staticmethod
    def _params_for(prompts: list, params) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * len(prompts)
        if isinstance(params, SamplingParams):
            return [params] * len(prompts)
        params = list(params)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts; give one or one each")
        return params

    def _encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this checkpoint has no tokenizer.json: give prompts as lists of token ids")
            return self.tokenizer.encode(prompt).ids
        if not all(isinstance(token, int) for token in prompt):
            raise ValueError("a prompt is a string or a list of int token ids")
        return list(prompt)

    @staticmethod
    def _result_output(prompt, prompt_ids: list[int], result) -> RequestOutput:
        completion = CompletionOutput(0, result.text, list(result.token_ids), result.finish_reason,
                                      result.logprobs)
        return RequestOutput(result.request_id, prompt if isinstance(prompt, str) else None, list(prompt_ids),
                             [completion], True, result.spec_decode, result.prompt_logprobs)

    def _output(self, prompt, seq: Sequence) -> RequestOutput:
        text = self.engine.output_text(seq)
        logprobs = list(seq.output_logprobs) if seq.output_logprobs is not None else None
        completion = CompletionOutput(0, text, list(seq.output_token_ids), seq.finish_reason, logprobs)
        prompt_logprobs = list(seq.prompt_logprobs) if seq.prompt_logprobs is not None else None
        return RequestOutput(seq.request_id, prompt if isinstance(prompt, str) else None,
                             list(seq.prompt_token_ids), [completion], seq.is_finished,
                             seq.spec_decode.copy(), prompt_logprobs)
