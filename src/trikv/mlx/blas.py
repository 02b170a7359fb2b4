"""Which BLAS library serves MLX's CPU matrix products in this process.

mlx's CPU build for Linux (the `mlx-cpu` wheel) bundles the reference BLAS, about 25 times slower than an
optimised one on float32 products (measured on 2 x86 cores: 5 against 137 GFLOP/s for a 512 x 896 x 4864 product).
An optimised BLAS that exports the same symbols, loaded first, takes over: `pip install mkl` and start Python with
`LD_PRELOAD=<venv>/lib/libmkl_rt.so.3`. bfloat16 and float16 products do not go through BLAS in mlx's CPU build.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def blas_library() -> str | None:
    """The file name of the library whose `cblas_sgemm` the process resolves (the one mlx calls once loaded), or
    None where it cannot be told (no such symbol loaded, or not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    import mlx.core  # noqa: F401  (loads the BLAS mlx links against)

    process = ctypes.CDLL(None)
    try:
        address = ctypes.cast(process.cblas_sgemm, ctypes.c_void_p).value
    except AttributeError:
        # No cblas_sgemm in the global scope: mlx's extension loads its own BLAS privately, so that one serves.
        return _mapped_blas()
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    info = _DlInfo()
    if not libc.dladdr(ctypes.c_void_p(address), ctypes.byref(info)) or not info.dli_fname:
        return None
    return os.path.basename(info.dli_fname.decode())


def is_reference_blas(name: str | None) -> bool:
    """True for the reference BLAS mlx-cpu's wheel bundles (`libblas-<hash>.so.3...`)."""
    return name is not None and name.startswith("libblas")


def _mapped_blas() -> str | None:
    """The BLAS mapped into the process from mlx's wheel folders (`mlx_cpu.libs` or `mlx/lib`), if any."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/" in line}
    except OSError:
        return None
    found = sorted(os.path.basename(p) for p in paths if "mlx" in p and "blas" in os.path.basename(p).lower())
    return found[0] if found else None
