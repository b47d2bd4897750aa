"""The target's outbox and the replica's router, wired to each other without Ray: every request gets
exactly its own deltas in order whatever the interleaving, its own error instead of them, nothing
after an abort; a broken stream fails every open request and the next one opens a new stream; a
reader that goes away aborts what it would have read."""

from __future__ import annotations

import asyncio
import random

import pytest

from target_service.assembly.delta_outbox import DeltaOutbox, RequestFailed, RequestScheduled
from target_service.assembly.delta_router import DeltaRouter
from target_service.engine.engine_client import EngineDead, QueueFull, RequestDelta
from target_service.engine.sampling_params import SamplingParams

PARAMS = SamplingParams(max_tokens=8)


class ScriptedEngine:
    """generate() yields each request's scripted deltas, yielding the loop a random number of times
    between them (so requests interleave differently each draw); a script that is an exception raises
    it before any delta. Records which streams were closed before their end."""

    def __init__(self, scripts: dict[str, list[RequestDelta] | BaseException], rng: random.Random):
        self.scripts, self.rng = scripts, rng
        self.closed_early: set[str] = set()
        self.started: list[str] = []

    async def generate(self, prompt_token_ids, params, request_id):
        self.started.append(request_id)
        script = self.scripts[request_id]
        if isinstance(script, BaseException):
            raise script
        finished = False
        try:
            for delta in script:
                for _ in range(self.rng.randrange(4)):
                    await asyncio.sleep(0)
                finished = delta.finished
                yield delta
        finally:
            if not finished:
                self.closed_early.add(request_id)


def random_script(request_id: str, rng: random.Random) -> list[RequestDelta]:
    count = rng.randrange(1, 9)
    return [RequestDelta(request_id, [rng.randrange(1000) for _ in range(rng.randrange(1, 7))], f"t{i}",
                         finished=i == count - 1, finish_reason="length" if i == count - 1 else None)
            for i in range(count)]


def start_all(engine: ScriptedEngine, ids, prompt=(1,)) -> tuple[DeltaOutbox, DeltaRouter, dict]:
    """An outbox over `engine` wired to a router, and every request of `ids` opened, then started
    (on the running loop): (outbox, router, each request's queue)."""
    outbox = DeltaOutbox(engine.generate)
    router = DeltaRouter(outbox.batches)
    queues = {request_id: router.open(request_id) for request_id in ids}
    for request_id in ids:
        outbox.start(list(prompt), PARAMS, request_id)
    return outbox, router, queues


async def read(queue: asyncio.Queue) -> list:
    """A request's items up to its finished delta or its failure."""
    items = []
    while True:
        item = await asyncio.wait_for(queue.get(), 5)
        items.append(item)
        if isinstance(item, (RequestFailed, BaseException)) or getattr(item, "finished", False):
            return items


def test_each_request_gets_exactly_its_deltas_in_order_and_its_own_error():
    rng = random.Random()
    ids = [f"req-{i}" for i in range(rng.randrange(6, 20))]
    scripts = {request_id: random_script(request_id, rng) for request_id in ids}
    refused = rng.sample(ids, 2)
    scripts[refused[0]] = ValueError("the prompt is longer than max_model_len")
    scripts[refused[1]] = QueueFull(7)
    engine = ScriptedEngine(scripts, rng)

    async def main():
        _, router, queues = start_all(engine, ids, prompt=(1, 2, 3))
        results = dict(zip(ids, await asyncio.gather(*(read(queues[i]) for i in ids))))
        await router.stop()
        return results, router

    results, router = asyncio.run(main())
    for request_id in ids:
        if request_id in refused:
            [failure] = results[request_id]
            assert isinstance(failure, RequestFailed) and failure.error is scripts[request_id]
        else:
            assert results[request_id] == scripts[request_id]
    assert router.num_items == sum(len(s) if isinstance(s, list) else 1 for s in scripts.values())
    assert router.num_batches < router.num_items  # deltas posted together leave together
    assert not engine.closed_early


def test_the_scheduled_time_comes_once_before_the_first_delta():
    rng = random.Random()
    scripts = {"a": random_script("a", rng), "b": random_script("b", rng)}
    engine = ScriptedEngine(scripts, rng)

    async def main():
        outbox, router, queues = start_all(engine, scripts)
        outbox.note_scheduled("a", 12.5)  # the engine's thread, before the step that made a's deltas
        outbox.note_scheduled("a", 99.0)  # later schedulings do not count
        outbox.note_scheduled("ghost", 1.0)  # nor does a request that is not here
        results = [await read(queues["a"]), await read(queues["b"])]
        await router.stop()
        return results

    items_a, items_b = asyncio.run(main())
    assert items_a[0] == RequestScheduled("a", 12.5) and items_a[1:] == scripts["a"]
    assert items_b == scripts["b"]


def test_an_abort_closes_the_engine_stream_and_nothing_more_arrives():
    rng = random.Random()
    scripts = {"kept": random_script("kept", rng),
               "left": [RequestDelta("left", [i], "x") for i in range(50)]}  # never finishes by itself
    engine = ScriptedEngine(scripts, rng)

    async def main():
        outbox, router, queues = start_all(engine, ["kept", "left"])
        kept, left = queues["kept"], queues["left"]
        first = await asyncio.wait_for(left.get(), 5)
        router.close("left")
        routed_before_close = left.qsize()
        assert outbox.abort("left") and not outbox.abort("left")
        items = await read(kept)
        for _ in range(10):
            await asyncio.sleep(0)
        await router.stop()
        return first, items, left.qsize() - routed_before_close, outbox.num_requests

    first, items, routed_after_close, running = asyncio.run(main())
    assert first == scripts["left"][0]
    assert items == scripts["kept"]
    assert engine.closed_early == {"left"} and running == 0
    assert routed_after_close == 0


def test_a_broken_stream_fails_every_open_request_and_the_next_opens_a_new_one():
    opened = []

    async def stream():
        opened.append(len(opened))
        yield [RequestDelta("a", [1], "x")]
        raise ConnectionError("actor died")

    async def main():
        router = DeltaRouter(stream, lambda error: f"the target died: {error}")
        a, b = router.open("a"), router.open("b")
        got = [await asyncio.wait_for(a.get(), 5), await asyncio.wait_for(a.get(), 5),
               await asyncio.wait_for(b.get(), 5)]
        c = router.open("c")  # after the break: a new stream
        got.append(await asyncio.wait_for(c.get(), 5))
        await router.stop()
        return got

    delta, dead_a, dead_b, dead_c = asyncio.run(main())
    assert delta == RequestDelta("a", [1], "x")
    for dead in (dead_a, dead_b, dead_c):
        assert isinstance(dead, EngineDead) and str(dead) == "the target died: actor died"
    assert opened == [0, 1]


def test_the_readers_end_aborts_every_request_unless_a_newer_reader_took_over():
    rng = random.Random()
    endless = {f"r{i}": [RequestDelta(f"r{i}", [j], "y") for j in range(1000)] for i in range(3)}
    engine = ScriptedEngine(endless, rng)

    async def main():
        outbox = DeltaOutbox(engine.generate)
        old = outbox.batches()
        for request_id in endless:
            outbox.start([1], PARAMS, request_id)
        assert await asyncio.wait_for(old.__anext__(), 5)
        new = outbox.batches()
        assert await asyncio.wait_for(new.__anext__(), 5)  # the newer reader takes over
        await old.aclose()
        running_after_old = outbox.num_requests
        await new.aclose()
        for _ in range(10):
            await asyncio.sleep(0)
        return running_after_old, outbox.num_requests

    running_after_old, running_after_new = asyncio.run(main())
    assert running_after_old == 3
    assert running_after_new == 0 and engine.closed_early == set(endless)


def test_a_request_id_already_running_is_refused_and_the_first_runs_on():
    rng = random.Random()
    scripts = {"same": random_script("same", rng)}
    engine = ScriptedEngine(scripts, rng)

    async def main():
        outbox = DeltaOutbox(engine.generate)
        router = DeltaRouter(outbox.batches)
        queue = router.open("same")
        outbox.start([1], PARAMS, "same")
        outbox.start([1], PARAMS, "same")
        with pytest.raises(ValueError, match="already open"):
            router.open("same")
        items = []
        while len(items) < len(scripts["same"]) + 1:
            items.append(await asyncio.wait_for(queue.get(), 5))
        await router.stop()
        return items

    items = asyncio.run(main())
    failures = [item for item in items if isinstance(item, RequestFailed)]
    assert len(failures) == 1 and "already running" in str(failures[0].error)
    assert [item for item in items if not isinstance(item, RequestFailed)] == scripts["same"]
    assert engine.started == ["same"]


def test_queue_full_crosses_a_pickle_as_it_is():
    import pickle

    error = pickle.loads(pickle.dumps(QueueFull(17, retry_after_s=3)))
    assert isinstance(error, QueueFull) and error.waiting == 17 and error.retry_after_s == 3
    assert str(error) == str(QueueFull(17))
