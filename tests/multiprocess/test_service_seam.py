"""The seam the service split rests on: three OS processes, one pool mapped by handle.

This process owns the pool (memory in /dev/shm and the block manager behind a gRPC server on
loopback); a spawned target process and a spawned drafter process each map it from the pickled
`PoolHandle`. The target drives the engine against `KVPoolClient` (PoolControl) and a `DraftControl`
that carries only row counts over a pipe; the per-step data (taps, positions, slots, bonus tokens,
block tables, drafts) crosses through the step buffers, which the drafter maps by their handle.
Greedy output, every draft proposed, and the pool's bytes must equal the single-process engine's:
outputs alone would not prove the drafter worked (greedy is lossless whatever the drafts); equal
drafts show the drafter read the same inputs from the step buffers; equal arenas, read in THIS
process, show that both other processes wrote their K/V and context into the one shared pool.
"""

from __future__ import annotations

import multiprocessing

import pytest
import torch
from engine_helpers import DraftRecorder, make_pair, random_prompts, recorded_reference

from drafter_service.assembler import DrafterArgs, DrafterAssembler
from kvpool_service.assembler import build_pool
from kvpool_service.client import KVPoolClient
from kvpool_service.server import BackgroundServer
from target_service.assembly.assembler import TargetAssembler
from target_service.assembly.engine_args import EngineArgs
from target_service.assembly.plan import EnginePlan, resolve_plan
from target_service.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
SPAWN = multiprocessing.get_context("spawn")
TIMEOUT_S = 120
pytestmark = pytest.mark.slow
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _sync(device: str) -> None:
    """Across processes, GPU work is ordered by hand: finish this side's writes before signalling.
    (A real channel would record a CUDA IPC event instead of synchronising the whole device.)"""
    if device == "cuda":
        torch.cuda.synchronize()


class PipeDraftControl:
    """DraftControl over a pipe to the drafter process: each call sends its counts and waits."""

    def __init__(self, conn, block_size: int, device: str):
        self.conn = conn
        self.block_size = block_size
        self.device = device

    def _call(self, *message):
        _sync(self.device)  # the step buffers' inputs are written before the drafter reads them
        self.conn.send(message)
        if not self.conn.poll(TIMEOUT_S):
            raise TimeoutError(f"the drafter process did not answer {message[0]}")
        error = self.conn.recv()
        if error is not None:
            raise RuntimeError(f"drafter process: {error}")

    def store_context(self, num_rows: int) -> None:
        self._call("store_context", num_rows)

    def settle(self) -> None:
        """Every call over the pipe waits for its answer: nothing is outstanding."""

    def propose(self, num_seqs: int, num_draft: int, num_block_cols: int) -> None:
        self._call("propose", num_seqs, num_draft, num_block_cols)


def _drafter_process(args: DrafterArgs, pool_handle, conn, threads: int) -> None:
    torch.set_num_threads(threads)
    assembler = DrafterAssembler(args).load()
    worker = assembler.build(pool_handle, conn.recv())  # the step buffers' handle, from the target
    conn.send(worker.block_size)
    while (message := conn.recv())[0] != "stop":
        try:
            getattr(worker, message[0])(*message[1:])
            _sync(args.device)  # drafts and context are written before the target reads on
            conn.send(None)
        except Exception as error:  # report it to the target instead of hanging it
            conn.send(repr(error))
    assembler.close()


def _target_process(plan: EnginePlan, address: str, pool_handle, drafter_conn, result_conn, prompts,
                    threads: int) -> None:
    torch.set_num_threads(threads)
    assembler = TargetAssembler(plan).load()
    buffers = assembler.create_step_buffers(share=True)  # a /dev/shm file the drafter maps
    drafter_conn.send(buffers.export())
    drafter = DraftRecorder(PipeDraftControl(drafter_conn, drafter_conn.recv(), plan.device), buffers)
    client = KVPoolClient(address)
    client.connect()
    engine = assembler.build(client, pool_handle, drafter)
    seqs = [engine.add_request(f"req-{i}", prompt, GREEDY) for i, prompt in enumerate(prompts)]
    while engine.has_unfinished:
        engine.step()
    _sync(plan.device)
    drafter_conn.send(("stop",))
    usage = client.stats()
    result_conn.send(([list(seq.output_token_ids) for seq in seqs], drafter.drafts,
                      engine.stats.num_accepted_tokens, usage.num_used_blocks))
    assembler.close()
    client.shutdown()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("storage", ["paged", "dense"])
def test_target_and_drafter_in_their_own_processes_equal_the_single_process_engine(tmp_path, storage, device):
    target, drafter = make_pair(tmp_path)
    prompts = random_prompts(3, 160)
    settings = dict(num_speculative_tokens=5, context_storage=storage, kv_cache_memory="4MiB",
                    tokens_per_block=16, max_num_seqs=4, max_model_len=128, device=device, dtype="float32")
    single, expected, recorder = recorded_reference(target, drafter, prompts, GREEDY, **settings)
    expected_accepted = single.stats.num_accepted_tokens
    groups = [group.name for group in single.assembly.pool.layout.spec.groups]
    expected_arenas = {name: single.assembly.pool.memory.arena(name).to("cpu", copy=True) for name in groups}
    single.close()
    assert len(recorder.drafts) >= 10  # enough steps for the comparison to mean something

    plan = resolve_plan(EngineArgs(target=str(target), drafter=str(drafter), **settings))
    sizer = TargetAssembler(plan)  # configs only: the pool process loads no weights
    pool = build_pool(plan.pool_args(sizer.kv_budget(), share=True))
    assert (pool.handle.shm_path is not None) == (device == "cpu")  # else a CUDA IPC handle
    server = BackgroundServer(pool.blocks, pool.layout).start()
    drafter_args = plan.drafter_args()
    target_end, drafter_end = SPAWN.Pipe()
    results, result_end = SPAWN.Pipe(duplex=False)
    threads = torch.get_num_threads()  # the reference's: equal bytes need equal rounding
    processes = [
        SPAWN.Process(target=_drafter_process, args=(drafter_args, pool.handle, drafter_end, threads)),
        SPAWN.Process(target=_target_process,
                      args=(plan, server.address, pool.handle, target_end, result_end, prompts, threads)),
    ]
    try:
        for process in processes:
            process.start()
        assert results.poll(TIMEOUT_S), "the target process sent no result"
        outputs, drafts, accepted, used_blocks = results.recv()
        for process in processes:
            process.join(TIMEOUT_S)
            assert process.exitcode == 0
        arenas = {name: pool.memory.arena(name).to("cpu", copy=True) for name in groups}
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
        server.stop()
        pool.close()
    assert outputs == expected
    assert drafts == recorder.drafts and accepted == expected_accepted
    assert used_blocks == 0
    assert ("draft" in groups) == (storage == "paged")
    for name in groups:
        assert arenas[name].abs().sum() > 0 and torch.equal(arenas[name], expected_arenas[name]), name
