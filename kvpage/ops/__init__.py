"""Compiled CPU kernels (torch.ops.kvpage.*), built on first use; see kvpage/ops/build.py."""

from kvpage.ops.build import load, unavailable_reason

__all__ = ["load", "unavailable_reason"]
