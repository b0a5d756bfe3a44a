"""Building and loading tandem's CPU kernels library (`csrc/cpu_kernels.c`): `library()`, the
ctypes handle with every kernel's signature declared, or None where it cannot be had.

The library is compiled from the C source on first use with the system's C compiler (`cc`,
`-O3 -march=native`, the compiler inductor's CPU backend needs anyway) into
`$TANDEM_KERNEL_CACHE` (default `~/.cache/tandem/kernels`), keyed by the source, the compiler
and the CPU's flags, and loaded with ctypes, which releases the GIL for the call (DBO's ubatch
threads keep running). Without a compiler, or with `TANDEM_CPU_KERNELS=0`, there is none.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

logger = logging.getLogger("tandem.platform.cpu_kernels")  # the module callers import

SOURCE = Path(__file__).with_name("csrc") / "cpu_kernels.c"
_FLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-std=gnu11", "-fopenmp")


def cache_dir() -> Path:
    return Path(os.environ.get("TANDEM_KERNEL_CACHE") or Path.home() / ".cache" / "tandem" / "kernels")


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return os.uname().machine


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _build(compiler: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256("\0".join((SOURCE.read_text(), compiler, version, *_FLAGS, _cpu_flags())).encode()).hexdigest()[:16]
    target = cache_dir() / f"cpu_kernels-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Ranks of one server build at once: each writes its own file and renames it into place.
    fd, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *_FLAGS, "-o", partial, str(SOURCE), "-lm"], check=True, capture_output=True,
                       text=True, timeout=120)  # fmt: skip
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


@lru_cache(maxsize=None)
def library() -> ctypes.CDLL | None:
    if os.environ.get("TANDEM_CPU_KERNELS", "1") == "0":
        return None
    compiler = _compiler()
    if compiler is None:
        logger.warning("no C compiler found: tandem's CPU kernels are off, the torch paths run instead")
        return None
    try:
        library = ctypes.CDLL(str(_build(compiler)))
    except (OSError, subprocess.SubprocessError) as error:
        detail = getattr(error, "stderr", "") or error
        logger.warning("tandem's CPU kernels did not build (%s): the torch paths run instead", detail)
        return None
    c_long, c_int, c_void_p = ctypes.c_long, ctypes.c_int, ctypes.c_void_p
    library.tandem_amx.restype = c_int
    library.tandem_packed_elements.argtypes = [c_long, c_long, c_int]
    library.tandem_packed_elements.restype = c_long
    library.tandem_pack.argtypes = [c_void_p, c_int, c_long, c_long, c_long, c_void_p]
    library.tandem_pack.restype = None
    library.tandem_linear.argtypes = [c_void_p, c_int, c_long, c_long, c_void_p, c_int, c_long, c_void_p, c_int]
    library.tandem_linear.restype = c_int
    library.tandem_moe.argtypes = [
        c_void_p, c_int, c_long, c_long, c_void_p, c_void_p, c_long, c_void_p, c_void_p, c_int, c_long, c_long,
        c_long, c_long, c_void_p, c_int,
    ]  # fmt: skip
    library.tandem_moe.restype = c_int
    library.tandem_decode_attention.argtypes = [
        c_void_p, c_void_p, c_void_p, c_int, c_long, c_long, c_long, c_long, c_long, c_long, c_void_p, c_long,
        c_void_p, c_long, c_long, c_long, c_long, c_long, c_long, ctypes.c_float, c_void_p,
    ]  # fmt: skip
    library.tandem_decode_attention.restype = c_int
    library.tandem_rope_and_cache.argtypes = [
        c_void_p, c_long, c_long, c_void_p, c_long, c_long, c_void_p, c_long, c_long, c_int, c_void_p, c_void_p,
        c_long, c_long, c_long, c_long, c_long, c_int, c_void_p, c_long, c_long, c_void_p, c_long, c_long, c_long,
        c_void_p, c_long, c_long, c_long, c_long, c_long, c_long, c_void_p,
    ]  # fmt: skip
    library.tandem_rope_and_cache.restype = c_int
    library.tandem_rms_norm.argtypes = [
        c_void_p, c_long, c_void_p, c_long, c_void_p, c_void_p, c_int, c_long, c_long, ctypes.c_float, c_void_p,
    ]  # fmt: skip
    library.tandem_rms_norm.restype = None
    library.tandem_topk_softmax.argtypes = [c_void_p, c_int, c_long, c_long, c_long, c_int, c_void_p, c_void_p]
    library.tandem_topk_softmax.restype = None
    library.tandem_sample.argtypes = [c_void_p, c_long, c_long, c_long, c_void_p, c_void_p, c_void_p]
    library.tandem_sample.restype = c_int
    return library
