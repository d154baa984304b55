"""Compiled CPU kernels (torch.ops.kvpage.*), built on first use; see kvpage/ops/build.py."""

from kvpage.ops.build import KERNEL_DTYPES, load, unavailable_reason

__all__ = ["KERNEL_DTYPES", "load", "unavailable_reason"]
