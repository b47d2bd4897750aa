"""The guard behind "no compile on the serving path", on CPU: Triton compiles a kernel again when an
integer argument changes class (equal to 1, divisible by 16) or a pointer its 16-byte alignment, so
within one launch plan (the same constexprs, which start-up compiles) no argument Triton specialises
may change class from step to step. The engine runs a randomised workload with its paged attention
under the Triton interpreter while every launch's argument classes are recorded; an argument whose
class varies within a plan must be in the kernel's do_not_specialize (integers) or
do_not_specialize_on_alignment (pointers) list. The first version of the GPU warm-up missed the
block table's width this way (1 page, then more)."""

from __future__ import annotations

import collections
import importlib
import inspect
import random

import pytest
import torch
from engine_helpers import make_pair

from dflash_cli.bench.varied_workload import VariedRequest, drive, varied_requests
from target_service.engine.sampling_params import SamplingParams
from target_service.llm import LLM

triton = pytest.importorskip("triton")
interpreter = pytest.importorskip("triton.runtime.interpreter")


def _class_of(value) -> str | None:
    """Triton's specialisation class of one argument (None: Triton does not specialise it)."""
    if isinstance(value, bool) or not isinstance(value, (int, torch.Tensor)):
        return None
    if isinstance(value, torch.Tensor):
        return "aligned" if value.data_ptr() % 16 == 0 else "unaligned"
    return "one" if value == 1 else "multiple of 16" if value % 16 == 0 else "other"


class LaunchRecorder:
    """Per (kernel, plan): every argument's classes over the launches."""

    def __init__(self):
        self.classes: dict[tuple, dict[str, set]] = collections.defaultdict(
            lambda: collections.defaultdict(set))

    def record(self, function, args, kwargs):
        parameters = list(inspect.signature(function.fn).parameters.values())
        bound = dict(zip([p.name for p in parameters], args)) | kwargs
        constexpr = {p.name for p in parameters if "constexpr" in str(p.annotation)}
        plan = (function.fn.__name__, tuple(sorted((name, repr(bound.get(name))) for name in constexpr)))
        free_ints = set(function.kwargs.get("do_not_specialize") or ())
        free_pointers = set(function.kwargs.get("do_not_specialize_on_alignment") or ())
        for name, value in bound.items():
            kind = _class_of(value)
            if name in constexpr or kind is None:
                continue
            if (isinstance(value, torch.Tensor) and name in free_pointers) or (
                    not isinstance(value, torch.Tensor) and name in free_ints):
                continue
            self.classes[plan][name].add(kind)

    def varying(self) -> list[str]:
        return [f"{plan[0]}: {name} took {sorted(kinds)} within one plan"
                for plan, arguments in self.classes.items() for name, kinds in arguments.items()
                if len(kinds) > 1]


def test_no_specialised_argument_changes_class_within_a_launch_plan(tmp_path, monkeypatch):
    recorder = LaunchRecorder()
    original = interpreter.InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        recorder.record(self, args, {k: v for k, v in kwargs.items() if k not in ("num_warps", "num_stages",
                                                                                   "launch_pdl")})
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(interpreter.InterpretedFunction, "run", recording_run)
    launcher = importlib.import_module("kernels.paged_attention")  # the package exports its function
    monkeypatch.setattr(launcher, "resolve_backend", lambda backend, device: "triton")
    target, drafter = make_pair(tmp_path)
    llm = LLM(target, drafter, device="cpu", dtype="float32", max_num_seqs=4, kv_cache_memory="8MiB",
              tokens_per_block=16, max_model_len=256, max_num_batched_tokens=64,
              max_prefill_tokens_with_decodes=24)
    try:
        seed = int(torch.randint(0, 2**31, ()).item())
        rng = random.Random(seed)
        requests = varied_requests(rng, 6, vocab_size=llm.engine.vocab_size, max_prompt=90, max_tokens=12)
        drive(llm.engine, requests, rng)
        for length in (3, 70):  # alone, so both decode the same plan: one page of table, then five
            alone = VariedRequest(f"alone-{length}", list(range(3, 3 + length)),
                                  SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), None)
            drive(llm.engine, [alone], rng)
    finally:
        llm.close()
    assert len(recorder.classes) >= 2  # the paged attention ran, under more than one plan
    assert not recorder.varying(), f"seed {seed}:\n" + "\n".join(recorder.varying())
