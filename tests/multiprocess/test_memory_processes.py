"""Pool memory across processes: a spawned process attaches and writes; files vanish with their owner.

Children are started with the spawn context (a fresh interpreter, as Ray workers are), never fork,
so nothing is inherited: the child sees the pool only through the handle it is given.
"""

import multiprocessing
import os
import signal
import tempfile
import traceback
from pathlib import Path

import pytest
import torch

from foundation.shm import sweep_stale_files
from kvpool_service.geometry import LayerGroup, PoolLayout, PoolSpec
from kvpool_service.memory import PoolMemory, StaleEpochError

SPAWN = multiprocessing.get_context("spawn")
TIMEOUT_S = 60


@pytest.fixture
def shm_dir():
    """A private directory in /dev/shm: other processes' sweeps of /dev/shm never look inside it."""
    path = Path(tempfile.mkdtemp(prefix="dflash-test-", dir="/dev/shm"))
    yield path
    leftovers = sorted(p.name for p in path.iterdir())
    for leftover in path.iterdir():
        leftover.unlink()
    path.rmdir()
    assert not leftovers, f"pool files left behind: {leftovers}"


def make_layout(num_blocks=2):
    target = LayerGroup(name="target", num_layers=3, num_kv_heads=2, head_dim=16, dtype="bfloat16")
    draft = LayerGroup(name="draft", num_layers=2, num_kv_heads=1, head_dim=16, dtype="float8_e4m3fn")
    return PoolLayout.create(PoolSpec(target=target, draft=draft, tokens_per_block=16), num_blocks)


def _report(conn, work, *args):
    """Run `work` in the child and send ("ok", result) or ("error", traceback) to the parent."""
    try:
        conn.send(("ok", work(*args)))
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def _attach_read_and_write(handle, layout, draft_values, scale, device_env):
    if device_env is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = device_env  # before this process touches CUDA
    with PoolMemory.attach(handle, layout) as pool:
        seen = pool.layer("target", 1).k_cache.float().cpu().tolist()
        pool.layer("draft", 0).v_cache.copy_(torch.tensor(draft_values).to(torch.float8_e4m3fn))
        pool.layer("draft", 1).k_scale.fill_(scale)
        if pool.device.type == "cuda":
            torch.cuda.synchronize()  # our writes are ordered before the parent reads
        return seen, str(pool.device)


def _child(conn, *args):
    _report(conn, _attach_read_and_write, *args)


def _own_pool_until_told(conn, layout, shm_dir):
    pool = PoolMemory.create(layout, shm_dir=shm_dir)
    conn.send(pool.export())
    conn.recv()  # "exit": return without close(); the finalizer must clean up at exit


def _expect_ok(conn, proc):
    assert conn.poll(TIMEOUT_S), "the child process sent nothing"
    status, payload = conn.recv()
    proc.join(TIMEOUT_S)
    assert status == "ok", payload
    assert proc.exitcode == 0
    return payload


def _share_and_check(device, device_env=None):
    with PoolMemory.create(make_layout(), device) as owner:
        written = torch.randn(2, 16, 2, 16).to(torch.bfloat16)
        owner.layer("target", 1).k_cache.copy_(written)
        draft_values = torch.randn(2, 16, 1, 16)
        scale = float(torch.rand(()) + 0.5)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        parent_conn, child_conn = SPAWN.Pipe()
        proc = SPAWN.Process(target=_child, args=(child_conn, owner.export(), owner.layout,
                                                  draft_values.tolist(), scale, device_env))
        proc.start()
        seen, child_device = _expect_ok(parent_conn, proc)

        assert torch.equal(torch.tensor(seen), written.float())  # the child read the owner's write
        draft = owner.arena("draft").cpu()
        expected = torch.zeros(draft.shape, dtype=torch.uint8)
        expected[:, 0, 1] = draft_values.to(torch.float8_e4m3fn).view(torch.uint8)
        assert torch.equal(draft.view(torch.uint8), expected)  # the owner sees the child's write, only there
        assert owner.scales("draft").cpu().tolist() == [[1.0, 1.0], [scale, 1.0]]
        return child_device


def test_spawned_process_attaches_and_both_see_each_others_writes():
    assert _share_and_check("cpu") == "cpu"


def test_owner_exit_removes_its_file_and_marks_attached_views_stale(shm_dir):
    layout = make_layout()
    parent_conn, child_conn = SPAWN.Pipe()
    proc = SPAWN.Process(target=_own_pool_until_told, args=(child_conn, layout, shm_dir))
    proc.start()
    assert parent_conn.poll(TIMEOUT_S)
    handle = parent_conn.recv()
    path = Path(handle.shm_path)
    attached = PoolMemory.attach(handle, layout)
    assert path.parent == shm_dir and path.exists() and path not in sweep_stale_files(shm_dir)
    parent_conn.send("exit")
    proc.join(TIMEOUT_S)
    assert proc.exitcode == 0
    assert not path.exists()
    with pytest.raises(StaleEpochError, match="holds epoch 0"):
        attached.check_epoch()
    attached.close()
    with pytest.raises(StaleEpochError, match="is gone"):
        PoolMemory.attach(handle, layout)


def test_killed_owner_leaves_a_file_that_the_next_pool_sweeps(shm_dir):
    layout = make_layout()
    parent_conn, child_conn = SPAWN.Pipe()
    proc = SPAWN.Process(target=_own_pool_until_told, args=(child_conn, layout, shm_dir))
    proc.start()
    assert parent_conn.poll(TIMEOUT_S)
    path = Path(parent_conn.recv().shm_path)
    assert path not in sweep_stale_files(shm_dir)  # alive: its lock protects it
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(TIMEOUT_S)
    assert proc.exitcode == -signal.SIGKILL
    assert path.exists()  # SIGKILL runs no finalizer
    with PoolMemory.create(make_layout(), shm_dir=shm_dir) as fresh:  # start-up sweeps dead owners' files
        assert not path.exists()
        assert Path(fresh.export().shm_path).exists()


@pytest.mark.gpu
def test_spawned_process_attaches_a_cuda_pool_by_gpu_uuid():
    # The pool lives on the last GPU; the child sees only that GPU (by UUID), as its index 0, so on
    # a machine with two or more GPUs the handle's device index must be remapped to be right.
    index = torch.cuda.device_count() - 1
    uuid = str(torch.cuda.get_device_properties(index).uuid)
    assert _share_and_check(f"cuda:{index}", device_env=f"GPU-{uuid}") == "cuda:0"
