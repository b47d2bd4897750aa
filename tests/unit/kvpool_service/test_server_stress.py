"""The server under random requests and under concurrent clients, on loopback.

Random requests (any epoch, ragged arrays, huge values, garbage bytes) must each get OK or one of the
five documented refusal codes with a message, never UNKNOWN or INTERNAL, and leave every pool
invariant intact. Sixteen clients hammering one server leave the pool exactly as their own mirrors
of the block tables say.
"""

from __future__ import annotations

import random
import threading
from collections import Counter

import grpc
import hypothesis.strategies as st
from hypothesis import HealthCheck, given, settings

from kvpool_service.block_manager import BlockManager
from kvpool_service.client import KVPoolClient
from kvpool_service.control import CommitRequest, OpenRequest, ReserveRequest
from kvpool_service.errors import PoolExhausted, UnknownSequence
from kvpool_service.geometry import LayerGroup, PoolLayout, PoolSpec
from kvpool_service.proto import kvpool_pb2 as pb
from kvpool_service.proto import kvpool_pb2_grpc
from kvpool_service.server import SERVICE_NAME, BackgroundServer

TPB = 16
REFUSALS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.NOT_FOUND,
            grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION}


def make_layout(num_blocks: int) -> PoolLayout:
    spec = PoolSpec(
        target=LayerGroup(name="target", num_layers=1, num_kv_heads=1, head_dim=16, dtype="float16"),
        draft=LayerGroup(name="draft", num_layers=1, num_kv_heads=1, head_dim=16, dtype="float16"),
        tokens_per_block=TPB)
    return PoolLayout.create(spec, num_blocks)


def check_invariants(blocks: BlockManager) -> None:
    """Each block in exactly one state; refcount = holders; only cached prefixes shared."""
    free, cached = set(blocks.free_block_ids()), set(blocks.cached_block_ids())
    holders = Counter(b for s in list(blocks._seqs) for b in blocks.get(s).block_table)
    assert not (free & cached) and not (free & set(holders)) and not (cached & set(holders))
    assert free | cached | set(holders) == set(range(blocks.num_blocks))
    for block in range(blocks.num_blocks):
        assert blocks.ref_count(block) == holders[block]
        assert holders[block] <= 1 or blocks.is_registered(block)
    usage = blocks.stats()
    assert usage.num_free_blocks + usage.num_cached_blocks + usage.num_used_blocks == blocks.num_blocks


u32 = st.one_of(st.integers(0, 200), st.integers(0, 2**32 - 1))
seq_ids = st.lists(st.one_of(st.integers(0, 6), st.just(2**64 - 1)), max_size=6)


def requests(epoch: int):
    epochs = st.sampled_from([0, epoch, epoch ^ 1, epoch])
    prompts = st.builds(pb.SequencePrompt, seq_id=st.integers(0, 6),
                        prompt_token_ids=st.lists(u32, max_size=40) | st.lists(st.just(1), max_size=200))
    return st.one_of(
        st.tuples(st.just("Open"), st.builds(pb.OpenRequest, epoch=epochs,
                                             sequences=st.lists(prompts, max_size=6))),
        st.tuples(st.just("Reserve"), st.builds(pb.ReserveRequest, epoch=epochs, seq_ids=seq_ids,
                                                lengths=st.lists(u32, max_size=6))),
        st.tuples(st.just("Commit"), st.builds(
            pb.CommitRequest, epoch=epochs, seq_ids=seq_ids, num_tokens=st.lists(u32, max_size=6),
            num_context=st.lists(u32, max_size=6), num_new_token_ids=st.lists(st.integers(0, 4), max_size=6),
            token_ids=st.lists(u32, max_size=12))),
        st.tuples(st.just("Close"), st.builds(pb.CloseRequest, epoch=epochs, seq_ids=seq_ids)),
        st.tuples(st.sampled_from(["Open", "Reserve", "Commit", "Close", "PoolStats"]),
                  st.binary(max_size=40)),
    )


def test_random_requests_get_a_documented_code_and_keep_the_invariants():
    layout = make_layout(num_blocks=24)
    blocks = BlockManager.from_layout(layout, max_num_seqs=4, max_model_len=128, watermark=0.0)
    seen = Counter()
    with BackgroundServer(blocks, layout) as server, grpc.insecure_channel(server.address) as channel:
        stub = kvpool_pb2_grpc.KVPoolStub(channel)

        @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
        @given(st.lists(requests(layout.epoch), min_size=1, max_size=8))
        def run(calls):
            for method, request in calls:
                if isinstance(request, bytes):
                    call = channel.unary_unary(f"/{SERVICE_NAME}/{method}")  # bytes in, bytes out
                else:
                    call = getattr(stub, method)
                try:
                    call(request, timeout=5)
                    seen["OK"] += 1
                except grpc.RpcError as error:
                    assert error.code() in REFUSALS, (method, request, error.code(), error.details())
                    assert error.details()
                    seen[error.code().name] += 1
                check_invariants(blocks)

        run()
    assert seen["OK"] > 0 and len(seen) >= 5, seen  # the generator reaches successes and refusals


def test_concurrent_clients_leave_the_pool_as_their_mirrors_say():
    num_clients, calls_per_client = 16, 200
    layout = make_layout(num_blocks=96)
    blocks = BlockManager.from_layout(layout, max_num_seqs=24, max_model_len=128, watermark=0.02)
    stems = [[7] * 32, [8] * 16 + [9] * 16, list(range(40))]
    mirrors: list[dict[int, list[int]]] = [{} for _ in range(num_clients)]
    failures: list[BaseException] = []

    def client_loop(index: int) -> None:
        rng, mirror = random.Random(index), mirrors[index]
        lengths: dict[int, tuple[int, int]] = {}  # seq_id -> (num_tokens, capacity)
        next_id = index * 10_000
        try:
            with KVPoolClient(server.address, timeout=10) as client:
                for _ in range(calls_per_client):
                    op = rng.choice(["open", "reserve", "commit", "close"] if mirror else ["open"])
                    try:
                        if op == "open":
                            prompt = [*rng.choice(stems)[:rng.randint(1, 40)], rng.randrange(50)]
                            [result] = client.open([OpenRequest(next_id, prompt)])
                            mirror[next_id] = result.block_table
                            lengths[next_id] = (result.num_cached_tokens, len(result.block_table) * TPB)
                            next_id += 1
                        elif op == "reserve":
                            seq_id = rng.choice(sorted(mirror))
                            length = min(128, lengths[seq_id][1] + rng.randint(0, 40))
                            [appended] = client.reserve([ReserveRequest(seq_id, length)])
                            mirror[seq_id] = mirror[seq_id] + appended
                            lengths[seq_id] = (lengths[seq_id][0], len(mirror[seq_id]) * TPB)
                        elif op == "commit":
                            seq_id = rng.choice(sorted(mirror))
                            done, capacity = lengths[seq_id]
                            done = rng.randint(done, min(capacity, 128))
                            client.commit([CommitRequest(seq_id, done, done)])
                            lengths[seq_id] = (done, capacity)
                        else:
                            seq_id = rng.choice(sorted(mirror))
                            client.close([seq_id])
                            del mirror[seq_id], lengths[seq_id]
                    except PoolExhausted:
                        pass  # contention: the scheduler would preempt or wait
                try:
                    client.close([index * 10_000 + 9_999])
                except UnknownSequence:
                    pass
                else:
                    raise AssertionError("closing a sequence that was never opened succeeded")
        except BaseException as error:
            failures.append(error)

    with BackgroundServer(blocks, layout) as server:
        threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(num_clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert not any(thread.is_alive() for thread in threads), "a client did not finish in time"
        assert not failures, failures[0]
        check_invariants(blocks)
        live = {seq_id: table for mirror in mirrors for seq_id, table in mirror.items()}
        assert set(blocks._seqs) == set(live)
        for seq_id, table in live.items():
            assert blocks.get(seq_id).block_table == table
        with KVPoolClient(server.address) as client:
            client.close(sorted(live)[:24])
            client.close(sorted(live)[24:])
            usage = client.stats()
        assert usage.num_seqs == 0 and usage.num_used_blocks == 0
        assert usage.num_free_blocks + usage.num_cached_blocks == layout.num_blocks
        check_invariants(blocks)
