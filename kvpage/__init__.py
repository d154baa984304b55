"""kvpage: an LLM inference engine whose KV cache is managed like virtual memory."""

__version__ = "0.1.0"
