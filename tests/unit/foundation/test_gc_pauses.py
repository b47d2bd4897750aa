"""The process's collector: its pauses timed from gc.callbacks, and the start-up heap frozen once (or
not, with DFLASH_GC_FREEZE=0)."""

from __future__ import annotations

import gc

from foundation.gc_pauses import GcPauses, freeze_startup_heap

LISTS, SLACK = 10_000, 1_000


def test_the_shared_watcher_times_a_real_collection():
    pauses = GcPauses.shared()
    assert GcPauses.shared() is pauses and gc.callbacks.count(pauses.on_gc) == 1
    garbage = [[object()] for _ in range(50_000)]
    for item in garbage:
        item.append(item)  # cycles: only the collector frees them
    del garbage
    gc.collect()
    collecting, generation = pauses.within(60.0)
    assert collecting > 0 and generation == 2


def test_the_start_up_heap_is_frozen_unless_switched_off(monkeypatch):
    gc.unfreeze()  # a replica built earlier in this process froze its heap
    try:
        monkeypatch.setenv("DFLASH_GC_FREEZE", "0")
        assert freeze_startup_heap() == 0 and gc.get_freeze_count() == 0
        monkeypatch.delenv("DFLASH_GC_FREEZE")
        frozen = freeze_startup_heap()
        assert frozen == gc.get_freeze_count() > 1000  # the interpreter's own modules at least
        replaced = [[object()] for _ in range(LISTS)]  # start-up objects in cycles, frozen below
        for item in replaced:
            item.append(item)
        freeze_startup_heap()
        # the lists (a bare object() is not tracked); the slack: objects frozen the first time that
        # died since (the test machinery's) are collected by this freeze (one, in a CI run)
        assert gc.get_freeze_count() >= frozen + LISTS - SLACK
        del replaced  # what a rebind replaces: garbage, but frozen
        assert gc.collect() == 0  # a frozen cycle is never collected ...
        again = freeze_startup_heap()  # ... until the next freeze thaws and collects it
        assert again == gc.get_freeze_count() < frozen + LISTS - SLACK
    finally:
        gc.unfreeze()
