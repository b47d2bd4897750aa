"""ChannelDraftControl: the engine in this process, its DraftWorker in a spawned one, joined only by
handles (pool, step buffers, step channel) as two Ray actors would be.

Greedy outputs alone would not show the drafter worked (greedy is lossless whatever the drafts), so
every draft proposed is compared with the single-process engine's, read back from the step buffers
after each call: equal drafts show the drafter process read this step's inputs and its drafts were
back before the engine read them. The drafter keeps serving after a worker error, which the target
sees as RemoteError text.
"""

from __future__ import annotations

import dataclasses
import multiprocessing

import pytest
from engine_helpers import DraftRecorder, make_pair, random_prompts, recorded_reference

from drafter_service.assembler import DrafterArgs, DrafterAssembler
from drafter_service.channel_control import ChannelDraftControl, DraftOp, serve_draft_worker
from foundation.cuda_ipc import export_buffer
from foundation.shared_buffer import BufferHandle
from foundation.step_channel import RemoteError, StepChannel
from kvpool_service.assembler import build_pool
from target_service.assembly.assembler import TargetAssembler
from target_service.assembly.engine_args import EngineArgs
from target_service.assembly.plan import resolve_plan
from target_service.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
SPAWN = multiprocessing.get_context("spawn")
TIMEOUT_S = 120
MAX_NUM_SEQS = 4
pytestmark = pytest.mark.slow


def _drafter_pool_handle(pool, device: str):
    """The handle the drafter process maps. On CPU the pool is a /dev/shm file that both processes map
    by path. On CUDA this process holds the pool privately (CUDA IPC cannot open an export in the
    exporting process, and the target here maps the pool through its handle) and the drafter gets a
    CUDA IPC handle of the same allocation."""
    if device == "cpu":
        return pool.handle
    cuda = export_buffer(pool.handle.buffer.in_process)
    return dataclasses.replace(pool.handle, buffer=BufferHandle(pool.handle.nbytes, cuda=cuda))


def _drafter_process(args: DrafterArgs, pool_handle, step_handle, channel_handle, stop) -> None:
    assembler = DrafterAssembler(args).load()
    worker = assembler.build(pool_handle, step_handle)
    channel = StepChannel.attach(channel_handle)
    try:
        serve_draft_worker(worker, channel, stop.is_set)
    finally:
        channel.close()
        assembler.close()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_drafter_process_behind_the_channel_drafts_what_the_in_process_worker_drafts(tmp_path, device):
    target, drafter = make_pair(tmp_path)
    prompts = random_prompts(3, 160)
    settings = dict(num_speculative_tokens=5, kv_cache_memory="4MiB", tokens_per_block=16,
                    max_num_seqs=MAX_NUM_SEQS, max_model_len=128, device=device, dtype="float32")
    single, expected, recorder = recorded_reference(target, drafter, prompts, GREEDY, **settings)
    expected_accepted = single.stats.num_accepted_tokens
    single.close()
    assert len(recorder.drafts) >= 10  # enough steps for the comparison to mean something

    plan = resolve_plan(EngineArgs(target=str(target), drafter=str(drafter), **settings))
    assembler = TargetAssembler(plan).load()
    block_size = plan.block_size
    pool = build_pool(plan.pool_args(assembler.kv_budget(), share=device == "cpu"))
    buffers = assembler.create_step_buffers(share=True)
    channel = StepChannel.create(device=device)
    drafter_args = plan.drafter_args()
    stop = SPAWN.Event()
    process = SPAWN.Process(target=_drafter_process,
                            args=(drafter_args, _drafter_pool_handle(pool, device), buffers.export(),
                                  channel.export(), stop))
    try:
        process.start()
        channel.wait_for_server(TIMEOUT_S)
        control = ChannelDraftControl(channel, block_size, timeout_s=TIMEOUT_S)
        assert control.ping() == block_size
        drafts = DraftRecorder(control, buffers)
        engine = assembler.build(pool.control, pool.handle, drafts)
        seqs = [engine.add_request(f"req-{i}", prompt, GREEDY) for i, prompt in enumerate(prompts)]
        while engine.has_unfinished:
            engine.step()
        outputs = [list(seq.output_token_ids) for seq in seqs]

        with pytest.raises(RemoteError, match=f"ValueError: num_seqs must be in 1..{MAX_NUM_SEQS}"):
            control.propose(0, 1, 1)
        with pytest.raises(RemoteError, match="ValueError: 99 is not a valid DraftOp"):
            channel.call(99)
        assert control.ping() == block_size and channel.call(DraftOp.PING) == block_size
        stop.set()
        process.join(TIMEOUT_S)
        assert process.exitcode == 0
    finally:
        stop.set()
        if process.is_alive():
            process.kill()
        channel.close()
        assembler.close()
        pool.close()
    assert outputs == expected
    assert drafts.drafts == recorder.drafts and engine.stats.num_accepted_tokens == expected_accepted
