"""Attention over the paged KV cache, by backends: the interface (``base.py``), the C++ CPU kernel
(``cpu_kernel.py``), the PyTorch reference (``torch_reference.py``), the one choice among them (``selector.py``),
and the cache's rows that they share (``kv_rows.py``)."""

from serval.layers.attention.base import AttentionBackend, AttentionMetadata, ScheduledSequence, paged_attention
from serval.layers.attention.kv_rows import (
    KV_CODE_DTYPES,
    SCALE_BYTES,
    dequantize_rows,
    is_quantized,
    new_kv_cache,
    quantize_rows,
    write_kv,
)
from serval.layers.attention.selector import select_backend

__all__ = ["KV_CODE_DTYPES", "SCALE_BYTES", "AttentionBackend", "AttentionMetadata", "ScheduledSequence",
           "dequantize_rows", "is_quantized", "new_kv_cache", "paged_attention", "quantize_rows", "select_backend",
           "write_kv"]
