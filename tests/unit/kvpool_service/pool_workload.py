"""A scheduler's pool calls as a random workload, run on several pools at once, and the pools it
needs: a bare BlockManager (the oracle), one counting its calls, one served over gRPC. Shared by the
leased-control and traffic tests."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from kvpool_service.block_manager import BlockManager
from kvpool_service.control import CommitRequest, OpenRequest, PoolControl, ReserveRequest
from kvpool_service.errors import LimitExceeded, UnknownSequence
from kvpool_service.geometry import LayerGroup, PoolLayout, PoolSpec
from kvpool_service.leased_control import LeasedPoolControl

TPB, MAX_LEN, MAX_SEQS, K = 4, 64, 4, 3
# Big enough that no workload below evicts a cached block, even with every sequence's lease held:
# then leases cannot change which prompts hit the prefix cache.
ROOMY = 4096
BASES = [[7, 1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4], [2, 2, 2, 2, 9, 9, 9, 9, 3, 3]]


def make_manager(num_blocks: int = ROOMY, *, epoch: int = 0, max_model_len: int = MAX_LEN,
                 tokens_per_block: int = TPB) -> BlockManager:
    return BlockManager(num_blocks, tokens_per_block, max_num_seqs=MAX_SEQS, max_model_len=max_model_len,
                        watermark=0.0, epoch=epoch)


class CountingPool:
    """Passes every verb to `inner`, counting calls and keeping the reserve requests sent."""

    def __init__(self, inner: PoolControl):
        self.inner, self.calls, self.reserves = inner, Counter(), []

    def open(self, requests):
        self.calls["open"] += 1
        return self.inner.open(requests)

    def reserve(self, requests):
        self.calls["reserve"] += 1
        self.reserves.append(list(requests))
        return self.inner.reserve(requests)

    def commit(self, requests):
        self.calls["commit"] += 1
        return self.inner.commit(requests)

    def close(self, seq_ids):
        self.calls["close"] += 1
        return self.inner.close(seq_ids)

    def stats(self):
        self.calls["stats"] += 1
        return self.inner.stats()

    def limits(self):
        return self.inner.limits()


# ---- the random workload, run on several pools at once -------------------------------------------


class Workload:
    """A scheduler's calls: open (some prompts re-use closed sequences' tokens), steps that reserve
    to num_computed + K + 1 and commit 1..K+1 accepted tokens with their ids, closes, stats."""

    def __init__(self, rng: random.Random, pools: list[tuple[PoolControl, BlockManager]]):
        self.rng, self.pools = rng, pools
        self.tables: list[dict[int, list[int]]] = [{} for _ in pools]  # the callers' block tables
        self.seqs: dict[int, dict] = {}  # seq_id -> tokens, computed, context, known
        self.finished: list[list[int]] = []
        self.next_id = 0

    def run(self, num_ops: int) -> None:
        for _ in range(num_ops):
            op = self.rng.choices(["open", "step", "close", "stats", "bad"], [3, 10, 2, 1, 1])[0]
            getattr(self, op)()
        self.check_pools()

    def prompt(self) -> list[int]:
        rng = self.rng
        if self.finished and rng.random() < 0.5:
            tokens = rng.choice(self.finished)
            tail = [rng.randrange(10) for _ in range(rng.randint(0, 3))]
            return (tokens[: rng.randint(1, len(tokens))] + tail)[:MAX_LEN]  # a prompt fits max_model_len
        base = rng.choice(BASES)
        return base[: rng.randint(1, len(base))] + [rng.randrange(10) for _ in range(rng.randint(0, 9))]

    def open(self) -> None:
        count = min(self.rng.randint(1, 2), MAX_SEQS - len(self.seqs))
        if count <= 0:
            return
        requests = [OpenRequest(self.next_id + i, self.prompt()) for i in range(count)]
        self.next_id += count
        answers = [pool.open(requests) for pool, _ in self.pools]
        for results in answers[1:]:  # block ids may differ (leases took some), nothing else
            assert [(r.seq_id, r.seq_index, r.num_cached_tokens, len(r.block_table)) for r in results] == [
                (r.seq_id, r.seq_index, r.num_cached_tokens, len(r.block_table)) for r in answers[0]]
        for tables, results in zip(self.tables, answers):
            for r in results:
                tables[r.seq_id] = list(r.block_table)
        for request, r in zip(requests, answers[0]):
            prompt = list(request.prompt_token_ids)
            self.seqs[r.seq_id] = {"tokens": prompt, "computed": r.num_cached_tokens,
                                   "context": r.num_cached_tokens, "known": len(prompt)}

    def step(self) -> None:
        if not self.seqs:
            return
        ids = [i for i in self.seqs if self.rng.random() < 0.8] or list(self.seqs)
        wanted = {i: min(self.seqs[i]["computed"] + K + 1, MAX_LEN) for i in ids}
        requests = [ReserveRequest(i, wanted[i]) for i in ids]
        for (pool, _), tables in zip(self.pools, self.tables):
            for i, new_blocks in zip(ids, pool.reserve(requests)):
                tables[i].extend(new_blocks)  # what Scheduler._reserve does
        commits = []
        for i in ids:
            seq = self.seqs[i]
            seq["computed"] = min(seq["computed"] + self.rng.randint(1, K + 1), wanted[i])
            while len(seq["tokens"]) < seq["computed"]:
                seq["tokens"].append(self.rng.randrange(10))
            # the draft context lags a token now and then (it never shrinks)
            seq["context"] = max(seq["context"], seq["computed"] - self.rng.choice([0, 0, 1]))
            new_ids = seq["tokens"][seq["known"]: seq["computed"]]
            seq["known"] = max(seq["known"], seq["computed"])
            commits.append(CommitRequest(i, seq["computed"], seq["context"], new_ids))
        for pool, _ in self.pools:
            pool.commit(commits)
        for i in ids:
            if self.seqs[i]["computed"] >= MAX_LEN:
                self.close_ids([i])

    def close(self) -> None:
        if self.seqs:
            self.close_ids(self.rng.sample(sorted(self.seqs), self.rng.randint(1, min(2, len(self.seqs)))))

    def close_ids(self, ids: list[int]) -> None:
        for pool, _ in self.pools:
            pool.close(ids)
        for tables in self.tables:
            for i in ids:
                del tables[i]
        for i in ids:
            seq = self.seqs.pop(i)
            self.finished.append(seq["tokens"][: seq["known"]])

    def stats(self) -> None:
        usages = [pool.stats() for pool, _ in self.pools]
        for usage in usages[1:]:
            assert (usage.num_seqs, usage.prefix_cache_queries, usage.prefix_cache_hits) == (
                usages[0].num_seqs, usages[0].prefix_cache_queries, usages[0].prefix_cache_hits)
        assert usages[0].num_seqs == len(self.seqs)
        self.check_pools()

    def bad(self) -> None:
        """A call every pool refuses the same way, at once."""
        if self.seqs and self.rng.random() < 0.5:
            request, error = ReserveRequest(min(self.seqs), MAX_LEN + 1), LimitExceeded
        else:
            request, error = ReserveRequest(10_000 + self.next_id, 4), UnknownSequence
        for pool, _ in self.pools:
            with pytest.raises(error):
                pool.reserve([request])

    def check_pools(self) -> None:
        for pool, _ in self.pools:
            if isinstance(pool, LeasedPoolControl):
                pool.flush()
        for (_, manager), tables in zip(self.pools, self.tables):
            assert sorted(tables) == sorted(self.seqs)
            for i, table in tables.items():
                assert table == manager.get(i).block_table, f"sequence {i}: caller's table != pool's"
        reference = self.pools[0][1]
        for _, manager in self.pools[1:]:
            for i in self.seqs:
                mine, theirs = manager.get(i), reference.get(i)
                assert (mine.num_tokens, mine.num_context, list(mine.token_ids), mine.num_hashed_blocks) == (
                    theirs.num_tokens, theirs.num_context, list(theirs.token_ids), theirs.num_hashed_blocks)


GRPC_TPB = 16  # a PoolSpec's least


def make_served(num_blocks: int) -> tuple[BlockManager, PoolLayout]:
    spec = PoolSpec(
        target=LayerGroup(name="target", num_layers=1, num_kv_heads=2, head_dim=16, dtype="bfloat16"),
        draft=LayerGroup(name="draft", num_layers=1, num_kv_heads=1, head_dim=16, dtype="bfloat16"),
        tokens_per_block=GRPC_TPB)
    layout = PoolLayout.create(spec, num_blocks)
    return make_manager(num_blocks, epoch=layout.epoch, tokens_per_block=GRPC_TPB), layout
