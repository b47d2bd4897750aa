"""The target's token tables as the drafter loads them: embedding and lm_head, read from the target
checkpoint by the drafter itself (no tensor is handed over from the target service).

The drafter embeds its noise block with the target's embedding and scores its drafts with the
target's lm_head (DFlash drafters ship neither). A tied checkpoint has one table serving both.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from foundation.checkpoint_config import TargetConfig
from foundation.weights import TensorIndex, check_tensors, empty_param, load_weights, token_tables_layout


class TargetTables(nn.Module):
    def __init__(self, config: TargetConfig, *, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        shape = [config.vocab_size, config.hidden_size]
        self.embed_tokens = empty_param(shape, dtype, device)
        self.lm_head = self.embed_tokens if config.tie_word_embeddings else empty_param(shape, dtype, device)


def load_target_tables(directory: str | Path, config: TargetConfig, *, dtype: torch.dtype,
                       device: torch.device | str, progress: bool = True) -> TargetTables:
    """Check the two tables' names and shapes in the headers, then read only them."""
    layout = token_tables_layout(config)
    index = TensorIndex(directory)
    check_tensors(index, layout, "target checkpoint's token tables", warn_unused=False)
    tables = TargetTables(config, dtype=dtype, device=device)
    load_weights(tables, index, layout, progress=progress)
    return tables.eval()
