"""The drafter's assembler: the target's token tables read by the drafter itself, and pools it refuses."""

import pytest
import torch
from tiny_checkpoints import write_drafter_checkpoint, write_target_checkpoint

from drafter_service.assembler import DrafterArgs, DrafterAssembler
from drafter_service.target_tables import load_target_tables
from foundation.checkpoint_config import load_target_config
from foundation.weights import CheckpointError
from kvpool_service.assembler import PoolArgs, build_pool
from kvpool_service.geometry import PoolSpec
from kvpool_service.memory import PoolAttachError
from target_service.runner.checkpoint import load_target


@pytest.mark.parametrize("tied", [False, True])
def test_token_tables_equal_the_target_models_own(tmp_path, tied):
    target_dir = write_target_checkpoint(tmp_path / "t", tied=tied, seed=int(torch.randint(0, 2**31, ())))
    config = load_target_config(target_dir)
    tables = load_target_tables(target_dir, config, dtype=torch.float32, device="cpu")
    target, _ = load_target(target_dir, dtype="float32")
    assert torch.equal(tables.embed_tokens, target.embed_weight)
    assert torch.equal(tables.lm_head, target.lm_head_weight)
    assert (tables.lm_head is tables.embed_tokens) == tied


def test_a_target_checkpoint_without_its_lm_head_is_named(tmp_path):
    target_dir = write_target_checkpoint(tmp_path / "t", tied=False)
    config = load_target_config(target_dir).model_copy(update={"vocab_size": 7})
    with pytest.raises(CheckpointError, match=r"mis-shaped tensors model.embed_tokens.weight"):
        load_target_tables(target_dir, config, dtype=torch.float32, device="cpu")


def test_the_drafter_refuses_a_pool_whose_draft_group_is_not_its_own(tmp_path):
    target_dir = write_target_checkpoint(tmp_path / "t")
    drafter_dir = write_drafter_checkpoint(tmp_path / "d", target_dir)
    target_config = load_target_config(target_dir)
    spec = PoolSpec.from_configs(target_config, None, tokens_per_block=16, dtype="float32")
    spec = spec.model_copy(update={"draft": spec.target.model_copy(update={"name": "draft"})})
    pool = build_pool(PoolArgs(spec=spec, budget_bytes=2**20, max_num_seqs=2, max_model_len=64, share=False))
    assembler = DrafterAssembler(DrafterArgs(drafter=str(drafter_dir), target=str(target_dir),
                                             dtype="float32", max_num_seqs=2, max_model_len=64)).load()
    try:
        with pytest.raises(PoolAttachError, match=r"pool layout mismatch: spec.draft.num_layers: pool has"):
            assembler.build(pool.handle, None)
    finally:
        pool.close()
