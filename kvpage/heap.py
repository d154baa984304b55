"""Handing freed heap memory back to the system.

glibc's allocator keeps what the process frees (the float32 copies a load makes, the activations of a
long prefill) and reuses it later; the resident size then stays at its high-water mark. `malloc_trim`
gives the free pages back. Called after the model is loaded and when a server's engine goes idle.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc

_trim = None


def return_freed_memory(collect: bool = True) -> None:
    """Give freed heap pages back to the system (after a gc pass when `collect`); nothing without glibc."""
    global _trim
    if collect:
        gc.collect()
    if _trim is None:
        name = ctypes.util.find_library("c")
        try:
            _trim = getattr(ctypes.CDLL(name), "malloc_trim", False) if name else False
        except OSError:
            _trim = False
    if _trim:
        _trim(0)
