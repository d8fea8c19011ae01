"""Fast CPU path: ``quant_cpu.cpp`` compiled once with the system C++ compiler, loaded by ctypes.

Why this and not torch.compile or numba: it needs no extra package (a compiler only, which
torch.compile's CPU backend needs too), builds in a few seconds once per machine (cached under
``~/.cache/bitscom``, keyed by source, flags, compiler and CPU), has no first-call tracing cost
per shape, and ctypes releases the GIL while it runs, so communication threads keep going. If no
compiler works, :func:`available` is False and dispatch falls back to the eager torch path.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import pathlib
import platform
import shutil
import subprocess
import sys
import tempfile
import warnings

from . import format as fmt

SOURCE = pathlib.Path(__file__).with_name("quant_cpu.cpp")
BASE_FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-ffp-contract=off", "-fno-math-errno",
              "-fno-trapping-math"]
# -march=native first (vectorized rint/floor/div); plain -O3 if the compiler refuses it.
FLAG_SETS = (["-march=native"], [])

_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_I32 = ctypes.c_int
_U32 = ctypes.c_uint32
_U64 = ctypes.c_uint64


def _compiler():
    for name in ("c++", "g++", "clang++"):
        path = shutil.which(name)
        if path:
            return path
    return None


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("flags", "model name"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() + platform.machine()


def _cache_dir() -> pathlib.Path:
    d = pathlib.Path.home() / ".cache" / "bitscom"
    try:
        d.mkdir(parents=True, exist_ok=True)
        if os.access(d, os.W_OK):
            return d
    except OSError:
        pass
    return pathlib.Path(tempfile.gettempdir())


def _build(cxx: str, flags: list[str]) -> pathlib.Path:
    src = SOURCE.read_bytes()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256(b"\0".join([src, " ".join(flags).encode(), version.encode(), _cpu_id().encode(),
                                     sys.platform.encode()])).hexdigest()[:20]
    lib = _cache_dir() / f"bitscom_quant_cpu_{key}.so"
    if lib.exists():
        return lib
    tmp = lib.with_name(f"{lib.name}.{os.getpid()}.tmp")
    proc = subprocess.run([cxx, *BASE_FLAGS, *flags, str(SOURCE), "-o", str(tmp)], capture_output=True,
                          text=True, timeout=300)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(proc.stderr[-2000:])
    os.replace(tmp, lib)  # atomic: concurrent ranks never load a half-written file
    return lib


@functools.lru_cache(maxsize=None)
def _lib():
    """Compile (once per machine) and load; None when no compiler or flag set works."""
    if not SOURCE.exists():
        return None
    cxx = _compiler()
    if cxx is None:
        warnings.warn("bitscom: no C++ compiler found; CPU quantization uses the slow eager torch path")
        return None
    errors = []
    for flags in FLAG_SETS:
        try:
            lib = ctypes.CDLL(str(_build(cxx, flags)))
            break
        except (RuntimeError, OSError, subprocess.SubprocessError) as e:
            errors.append(str(e))
    else:
        warnings.warn("bitscom: building the native CPU quantization loop failed; using the slow eager "
                      "torch path. Compiler output:\n" + "\n".join(errors)[-2000:])
        return None
    lib.bq_quantize.argtypes = [_P, _I64, _I32, _I32, _I32, _U32, _U32, _U64, _P, _P]
    lib.bq_dequant_acc.argtypes = [_P, _I64, _P, _I64, _I32, _I64, _I32, _I32, _P, _I32]
    lib.bq_dsr.argtypes = [_P, _I64, _P, _I64, _I32, _I64, _I32, _I32, _I32, ctypes.c_float, _I32, _U32,
                           _U32, _U64, _P, _P, _P]
    for f in (lib.bq_quantize, lib.bq_dequant_acc, lib.bq_dsr):
        f.restype = _I32
    return lib


def available() -> bool:
    """True when the compiled library loads (compiling it on the first call)."""
    return _lib() is not None


def _check(rc):
    if rc != 0:
        raise RuntimeError(f"native quantization kernel failed with code {rc}")


def quantize_pack(x, bits, block_size, stochastic, seed, index_offset, payload, scales):
    k1, k2 = fmt.seed_keys(seed)
    _check(_lib().bq_quantize(x.data_ptr(), x.numel(), bits, block_size, int(stochastic), k1, k2,
                              index_offset, payload.data_ptr(), scales.data_ptr()))
    return payload, scales


def unpack_dequantize_accumulate(payloads, scales, numel, bits, block_size, out, accumulate):
    if numel:
        _check(_lib().bq_dequant_acc(payloads.data_ptr(), payloads.stride(0), scales.data_ptr(),
                                     scales.stride(0), payloads.shape[0], numel, bits, block_size,
                                     out.data_ptr(), int(accumulate)))
    return out


def dequantize_sum_requantize(payloads, scales, numel, bits, block_size, out_bits, alpha, stochastic, seed,
                              index_offset, payload, out_scales, sum_out):
    k1, k2 = fmt.seed_keys(seed)
    _check(_lib().bq_dsr(payloads.data_ptr(), payloads.stride(0), scales.data_ptr(), scales.stride(0),
                         payloads.shape[0], numel, bits, block_size, out_bits, alpha, int(stochastic), k1,
                         k2, index_offset, payload.data_ptr(), out_scales.data_ptr(),
                         None if sum_out is None else sum_out.data_ptr()))
    return payload, out_scales
