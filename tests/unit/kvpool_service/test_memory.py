"""Pool memory in one process: segment layout, per-layer views, fp8 scales, and what attach refuses."""

import errno
import os
import pickle
from pathlib import Path

import pytest
import torch

from foundation import cuda_ipc, shm
from foundation.shared_buffer import BufferHandle
from kvpool_service.geometry import LayerGroup, PoolLayout, PoolSpec
from kvpool_service.memory import (
    HEADER_BYTES,
    PoolAttachError,
    PoolHandle,
    PoolMemory,
    StaleEpochError,
    plan_segments,
)


def make_spec(draft_dtype="float8_e4m3fn", *, with_draft=True, target_layers=2):
    target = LayerGroup(name="target", num_layers=target_layers, num_kv_heads=2, head_dim=16,
                        dtype="bfloat16")
    draft = LayerGroup(name="draft", num_layers=1, num_kv_heads=1, head_dim=32, dtype=draft_dtype)
    return PoolSpec(target=target, draft=draft if with_draft else None, tokens_per_block=16)


@pytest.fixture
def pool():
    with PoolMemory.create(PoolLayout.create(make_spec(), num_blocks=3)) as memory:
        yield memory


def test_segments_follow_the_design_layout_at_hand_computed_offsets():
    segments, total = plan_segments(PoolLayout.create(make_spec(), num_blocks=3))
    # target: 3 blocks x 2 layers x (K,V) x 16 tokens x 2 heads x 16 dims x 2 bytes = 12288 bytes
    # draft:  3 x 1 x 2 x 16 x 1 x 32 x 1 byte (fp8) = 3072 bytes; its scales: 1 layer x 2 x 4 bytes
    assert [(s.name, s.offset, s.shape, s.dtype, s.nbytes) for s in segments] == [
        ("target", 4096, (3, 2, 2, 16, 2, 16), torch.bfloat16, 12288),
        ("draft", 16384, (3, 1, 2, 16, 1, 32), torch.float8_e4m3fn, 3072),
        ("draft.scales", 20480, (1, 2), torch.float32, 8),
    ]
    assert total == 24576


def test_arena_bytes_match_the_spec_price_per_token():
    layout = PoolLayout.create(make_spec(), num_blocks=5)
    segments, _ = plan_segments(layout)
    by_name = {s.name: s for s in segments}
    for group in layout.spec.groups:
        assert by_name[group.name].nbytes == 5 * layout.spec.tokens_per_block * group.bytes_per_token
    assert by_name["draft.scales"].nbytes == layout.spec.draft.scale_bytes


@pytest.mark.parametrize("group", ["target", "draft"])
def test_layer_views_are_strided_and_touch_exactly_their_slice(pool, group):
    arena = pool.arena(group)
    n, num_layers, two, t, h, d = arena.shape
    assert two == 2 and n == 3 and t == 16
    for layer in range(num_layers):
        kv = pool.layer(group, layer)
        for which, view in ((0, kv.k_cache), (1, kv.v_cache)):
            arena.zero_()
            values = torch.randn(n, t, h, d).to(arena.dtype)
            view.copy_(values)
            expected = torch.zeros(arena.shape, dtype=torch.float32)
            expected[:, layer, which] = values.float()
            assert torch.equal(arena.float(), expected)
            # contiguous [N, L, 2, T, H, D] strides with the L and (K,V) dims dropped
            assert view.shape == (n, t, h, d)
            assert view.stride() == (num_layers * 2 * t * h * d, h * d, d, 1)
            offset_elems = (layer * 2 + which) * t * h * d
            assert view.data_ptr() == arena.data_ptr() + offset_elems * arena.element_size()


def test_fp8_group_carries_shared_per_layer_scales_starting_at_one(pool):
    scales = pool.scales("draft")
    assert scales.dtype == torch.float32 and scales.shape == (1, 2)
    assert torch.equal(scales, torch.ones(1, 2))
    kv = pool.layer("draft", 0)
    kv.k_scale.fill_(0.25)
    kv.v_scale.fill_(4.0)
    assert scales.tolist() == [[0.25, 4.0]]
    assert pool.layer("target", 1).k_scale is None
    with pytest.raises(ValueError, match="'target' is bfloat16; only fp8 groups carry scales"):
        pool.scales("target")


def test_attach_in_process_maps_the_same_bytes_both_ways(pool):
    with PoolMemory.attach(pool.export(), pool.layout) as attached:
        values = torch.randn(3, 16, 2, 16).to(torch.bfloat16)
        attached.layer("target", 1).v_cache.copy_(values)
        assert torch.equal(pool.layer("target", 1).v_cache, values)
        draft = torch.randn(3, 16, 1, 32).to(torch.float8_e4m3fn)
        pool.layer("draft", 0).k_cache.copy_(draft)
        assert torch.equal(attached.layer("draft", 0).k_cache.view(torch.uint8), draft.view(torch.uint8))
        assert not attached.is_owner and attached.nbytes == pool.nbytes


def test_export_is_made_once_and_names_a_dev_shm_file(pool):
    handle = pool.export()
    assert pool.export() is handle
    assert handle.cuda is None and Path(handle.shm_path).parent == Path("/dev/shm")
    assert os.path.getsize(handle.shm_path) == handle.nbytes == plan_segments(pool.layout)[1]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda layout: layout.model_copy(update={"num_blocks": 4}), "num_blocks: pool has 3, expected 4"),
        (lambda layout: layout.model_copy(update={"spec": make_spec("bfloat16")}),
         "spec.draft.dtype: pool has 'float8_e4m3fn', expected 'bfloat16'"),
        (lambda layout: layout.model_copy(update={"spec": make_spec(with_draft=False)}),
         "spec.draft: pool has"),
        (lambda layout: layout.model_copy(update={"spec": make_spec(target_layers=3)}),
         "spec.target.num_layers: pool has 2, expected 3"),
    ],
)
def test_attach_refuses_a_mismatched_layout_naming_the_field(pool, change, message):
    with pytest.raises(PoolAttachError, match=message) as info:
        PoolMemory.attach(pool.export(), change(pool.layout))
    assert type(info.value) is PoolAttachError  # a config bug, not a restart


def test_attach_refuses_a_handle_of_a_restarted_pool():
    old = PoolMemory.create(PoolLayout.create(make_spec(), num_blocks=3))
    old_handle = old.export()
    old.close()
    with PoolMemory.create(PoolLayout.create(make_spec(), num_blocks=3)) as new:
        message = f"epoch {old.layout.epoch}.*now has epoch {new.layout.epoch}"
        with pytest.raises(StaleEpochError, match=message):
            PoolMemory.attach(old_handle, new.layout)
    with pytest.raises(StaleEpochError, match="is gone"):
        PoolMemory.attach(old_handle, old.layout)


def test_attach_checks_the_epoch_written_in_the_memory_itself(pool):
    # a handle that claims another epoch but points at this pool's file: the header disagrees
    other = PoolLayout(spec=pool.layout.spec, num_blocks=3, epoch=pool.layout.epoch ^ 1)
    forged = PoolHandle(other, pool.export().buffer)
    message = f"holds epoch {pool.layout.epoch}.*expected epoch {other.epoch}"
    with pytest.raises(StaleEpochError, match=message):
        PoolMemory.attach(forged, other)


def test_attach_refuses_memory_that_is_not_a_pool(tmp_path, pool):
    path = tmp_path / "not-a-pool"
    path.write_bytes(b"x" * pool.nbytes)
    with pytest.raises(PoolAttachError, match="not a dflash pool"):
        PoolMemory.attach(PoolHandle(pool.layout, BufferHandle(pool.nbytes, shm_path=str(path))), pool.layout)
    message = f"holds {pool.nbytes + 8} bytes, its layout needs {pool.nbytes}"
    with pytest.raises(PoolAttachError, match=message):
        oversized = BufferHandle(pool.nbytes + 8, shm_path=str(path))
        PoolMemory.attach(PoolHandle(pool.layout, oversized), pool.layout)


def test_attached_process_notices_its_owner_closed():
    owner = PoolMemory.create(PoolLayout.create(make_spec(), num_blocks=2))
    attached = PoolMemory.attach(owner.export(), owner.layout)
    attached.check_epoch()
    owner.close()
    with pytest.raises(StaleEpochError, match="holds epoch 0"):
        attached.check_epoch()
    attached.close()


def test_close_removes_the_file_and_is_final():
    owner = PoolMemory.create(PoolLayout.create(make_spec(), num_blocks=2))
    path = Path(owner.export().shm_path)
    assert path.exists()
    owner.close()
    owner.close()
    assert not path.exists()
    with pytest.raises(RuntimeError, match="is closed"):
        owner.arena("target")
    with pytest.raises(RuntimeError, match="is closed"):
        owner.export()


def test_unshared_pool_has_the_same_views_but_no_file_and_a_handle_that_stays_in_process():
    layout = PoolLayout.create(make_spec(), num_blocks=3)
    with PoolMemory.create(layout, share=False) as private:
        assert not [name for name in os.listdir("/dev/shm") if name.endswith(f"-{layout.epoch:016x}")]
        values = torch.randn(3, 16, 2, 16).to(torch.bfloat16)
        private.layer("target", 0).v_cache.copy_(values)
        assert torch.equal(private.arena("target")[:, 0, 1], values)
        assert private.scales("draft").tolist() == [[1.0, 1.0]]
        handle = private.export()
        with PoolMemory.attach(handle, layout) as attached:  # the in-process assemblers' path
            assert torch.equal(attached.layer("target", 0).v_cache, values)
        with pytest.raises(TypeError, match="in-process buffer handle cannot leave its process"):
            pickle.dumps(handle)


def test_sweep_leaves_a_live_owners_file_alone(pool):
    path = Path(pool.export().shm_path)
    assert path not in shm.sweep_stale_files()
    assert path.exists()


def test_a_full_dev_shm_fails_at_create_with_the_sizes(monkeypatch):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shm.os, "posix_fallocate", full)
    ours = lambda: {name for name in os.listdir("/dev/shm") if name.startswith(f"dflash-pool-{os.getpid()}-")}
    before = ours()
    message = r"cannot reserve 24576 bytes for the pool in /dev/shm \(\d+ bytes free\)"
    with pytest.raises(OSError, match=message):
        PoolMemory.create(PoolLayout.create(make_spec(), num_blocks=3))
    assert ours() <= before  # nothing half-made is left behind


def test_bad_arguments_get_clear_errors(pool):
    with pytest.raises(ValueError, match="lives on 'cpu' or 'cuda', got device 'meta'"):
        PoolMemory.create(pool.layout, "meta")
    with pytest.raises(TypeError, match="layout must be a PoolLayout, got dict"):
        PoolMemory.create({"num_blocks": 3})
    with pytest.raises(TypeError, match="handle must be a PoolHandle, got str"):
        PoolMemory.attach(pool.export().shm_path, pool.layout)
    with pytest.raises(TypeError, match="expected_layout must be a PoolLayout"):
        PoolMemory.attach(pool.export(), pool.layout.spec)
    message = r"unknown layer group 'drafter'; this pool has \['target', 'draft'\]"
    with pytest.raises(ValueError, match=message):
        pool.layer("drafter", 0)
    with pytest.raises(IndexError, match="layer 2 is out of range for group 'target' of 2 layers"):
        pool.layer("target", 2)
    with pytest.raises(ValueError, match="exactly one of shm_path"):
        PoolHandle(pool.layout, BufferHandle(pool.nbytes))
    with (
        PoolMemory.attach(pool.export(), pool.layout) as attached,
        pytest.raises(RuntimeError, match="only the pool's owner exports it"),
    ):
        attached.export()


def test_cuda_attach_names_the_missing_gpu_uuid():
    with pytest.raises(LookupError, match="no visible CUDA device has UUID 00000000-dead"):
        cuda_ipc.local_device_index("00000000-dead")
    with pytest.raises(ValueError, match="exports CUDA tensors, got a tensor on cpu"):
        cuda_ipc.export_buffer(torch.zeros(HEADER_BYTES, dtype=torch.uint8))


def test_stale_memory_is_the_same_error_type_as_a_stale_control_epoch():
    from kvpool_service.errors import StaleEpoch
    from kvpool_service.memory import StaleEpochError

    assert issubclass(StaleEpochError, StaleEpoch) and issubclass(StaleEpochError, ValueError)
