"""An embedding whose table stays in a GGUF file's blocks: each step dequantizes only the rows it looks up."""

from __future__ import annotations

import torch
from torch import nn

from serval.layers.linear import BlockWeight, dequantized_panel_rows, same_width_int


def dense_embedding(num_embeddings: int, embedding_dim: int) -> nn.Embedding:
    """``nn.Embedding(num_embeddings, embedding_dim)`` without gradients, its table drawn as nn.Embedding draws it
    (the same values for the same seed), but left empty on the meta device (a load's model before its weights are
    read): there the draw is a decomposition whose first call imports torch._dynamo, 1.7 s of every start."""
    weight = torch.empty(num_embeddings, embedding_dim)
    if not weight.is_meta:
        nn.init.normal_(weight)
    return nn.Embedding(num_embeddings, embedding_dim, _weight=weight, _freeze=True)


class BlockEmbedding(nn.Module):
    """``nn.Embedding`` over a table [vocab, hidden] in blocks, laid out as the block kernel's panels
    (BlockWeight.panels): the rows of the ids asked, dequantized exactly (float32) and rounded once to ``dtype``, the
    values a dense table loaded from the same blocks holds. A large vocabulary's table is then in memory at the
    file's 4 to 8 bits a weight, not 16 (Llama 3's 128k × 4096: 0.3 GB as Q4_K, 1 GB as bfloat16), and once
    only where the head is tied to it: both read the same panels (``of_head``)."""

    def __init__(self, format: str, panels: torch.Tensor, scales: torch.Tensor, num_embeddings: int,
                 embedding_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.format = format
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.dtype = dtype
        self.register_buffer("panels", panels)
        self.register_buffer("scales", scales)

    @classmethod
    def of_blocks(cls, weight: BlockWeight, dtype: torch.dtype, device: str | torch.device = "cpu") -> BlockEmbedding:
        panels, scales = weight.panels()
        return cls(weight.format, panels.to(device), scales.view(same_width_int(scales.dtype)).to(device),
                   weight.out_features, weight.in_features, dtype)

    @classmethod
    def of_head(cls, head: nn.Module, dtype: torch.dtype) -> BlockEmbedding | None:
        """The embedding that reads a tied head's panels (a BlockQuantLinear of one part that keeps them), or None."""
        if len(getattr(head, "formats", ())) != 1 or not hasattr(head, "panels0"):
            return None
        return cls(head.formats[0], head.panels0, head.panel_scales0, head.out_features, head.in_features, dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = dequantized_panel_rows(self.format, self.panels, self.scales, input_ids.reshape(-1), self.embedding_dim)
        return rows.to(self.dtype).view(*input_ids.shape, self.embedding_dim)


def embedding_dtype(embedding: nn.Module) -> torch.dtype:
    """The dtype of the rows an embedding (dense or in blocks) gives."""
    return embedding.dtype if isinstance(embedding, BlockEmbedding) else embedding.weight.dtype
