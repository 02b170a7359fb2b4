"""Handing freed heap memory back to the operating system.

Each decode step allocates tensors whose size grows with the sequence (attention logits over every key,
the longer mask and token row). glibc keeps freed blocks for reuse, but a block freed by one step is too
small for the same request one step later, so the free blocks pile up and the process's resident memory
grows with every step although the live tensors do not: a long batched generation can run out of memory
on a machine that holds its model and cache with room to spare. `malloc_trim` returns the free pages.
"""

from __future__ import annotations

import ctypes
import functools


@functools.cache
def _malloc_trim():
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (macOS, musl): its allocator manages this itself
        return None


def release_free_heap() -> bool:
    """Return the heap's free pages to the OS (glibc `malloc_trim(0)`); False where that is not available."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
