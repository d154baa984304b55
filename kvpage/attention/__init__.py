"""Attention over the paged KV cache: explicit metadata, a backend interface, the reference backend."""

from kvpage.attention.backend import AttentionBackend, get_backend
from kvpage.attention.layer_kv import LayerKV
from kvpage.attention.metadata import AttentionMetadata

__all__ = ["AttentionBackend", "AttentionMetadata", "LayerKV", "get_backend"]
