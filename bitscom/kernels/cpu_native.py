"""Fast CPU path: ``quant_cpu.cpp`` compiled once with the system C++ compiler, loaded by ctypes.

Why not torch.compile or numba: no extra package (a compiler only, which torch.compile's CPU
backend needs too), a few seconds' build once per machine (cached, keyed by source, flags,
compiler and CPU: :func:`cache_dir`), no tracing cost per shape, and ctypes releases the GIL, so
communication threads keep going. Without a compiler, dispatch falls back to the torch path.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import pathlib
import platform
import shutil
import stat
import subprocess
import sys
import tempfile
import warnings
from typing import List, Optional, Tuple

from . import format as fmt

SOURCE = pathlib.Path(__file__).with_name("quant_cpu.cpp")
BASE_FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-ffp-contract=off", "-fno-math-errno",
              "-fno-trapping-math"]
# -march=native first (vectorized rint/floor/div); plain -O3 if the compiler refuses it.
FLAG_SETS: Tuple[List[str], ...] = (["-march=native"], [])
TOPK_MAX_NUMEL = 2 ** 31 - 1     # the largest x topk() takes
LOWRANK_MAX_RANK = 64            # the largest rank lowrank_project() takes

_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_I32 = ctypes.c_int
_U32 = ctypes.c_uint32
_U64 = ctypes.c_uint64
_F32 = ctypes.c_float
# Argument types of the kernels (each returns an int status). _OPTIONAL ones may be missing from
# a library built from another source, which then still loads (see the has_* functions).
_REQUIRED = {"bq_quantize": [_P, _I64, _I32, _I32, _I32, _U32, _U32, _U64, _P, _P],
             "bq_dequant_acc": [_P, _I64, _P, _I64, _I32, _I64, _I32, _I32, _P, _I32],
             "bq_dsr": [_P, _I64, _P, _I64, _I32, _I64, _I32, _I32, _I32, _F32, _I32, _U32, _U32, _U64, _P, _P, _P],
             "bq_sign_encode": [_P, _P, _I64, _P, _I64, _P, _P, _I32],
             "bq_sign_decode_sum": [_P, _I64, _I32, _I64, _I64, _P, _I64, _P, _F32]}
_OPTIONAL = {"bq_quantize_ef": [_P, _P, _I64, _I32, _I32, _I32, _U32, _U32, _U64, _P, _P],
             "bq_scatter": [_P, _I64, _P, _I32, _P, _I64, _I32],
             "bq_lr_project_p": [_P, _I64, _I64, _P, _I32, _P, _I32, _P],
             "bq_lr_project_q": [_P, _I64, _I64, _P, _I32, _P, _I32, _P],
             "bq_lr_product": [_P, _I64, _I64, _P, _P, _I32],
             "bq_topk": [_P, _I64, _I64, _P, _P, _P]}


def compiler():
    """The C++ compiler the native kernels are built with (None: none found)."""
    return next(filter(None, map(shutil.which, ("c++", "g++", "clang++"))), None)


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("flags", "model name"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() + platform.machine()


def _problem(st: os.stat_result, kind: str) -> Optional[str]:
    """Why a cache entry (from ``os.lstat``) must not be trusted, or None."""
    if stat.S_ISLNK(st.st_mode):
        return "it is a symbolic link"
    if kind == "dir" and not stat.S_ISDIR(st.st_mode):
        return "it is not a directory"
    if kind == "file" and not stat.S_ISREG(st.st_mode):
        return "it is not a regular file"
    if st.st_uid != os.geteuid():
        return f"it is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"it is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _above_problem(st: os.stat_result) -> Optional[str]:
    """Why a directory above the cache (from ``os.lstat``) must not be trusted, or None (docs/format.md)."""
    if stat.S_ISLNK(st.st_mode):
        return "it is a symbolic link"      # only seen if it is swapped in while we look
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a directory, so the cache cannot be created"
    if st.st_uid not in (0, os.geteuid()):
        return f"it is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()}) or root"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not (st.st_mode & stat.S_ISVTX and st.st_uid == 0):
        return (f"it is writable by group or others (mode {stat.S_IMODE(st.st_mode):o}) and is not a "
                "root-owned sticky directory like /tmp")
    return None


def _make_private(path: pathlib.Path) -> os.stat_result:
    """``os.lstat(path)``, creating ``path`` with mode 0700 first when it is missing."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    return os.lstat(path)


def _walk(d: pathlib.Path) -> tuple:
    """Create and check every directory from ``/`` down to the cache ``d``: ``(resolved path, problem or None)``."""
    parent = pathlib.Path(os.path.realpath(d.parent))
    for p in [*reversed(parent.parents), parent]:
        problem = _above_problem(_make_private(p))
        if problem:
            return parent / d.name, f"the directory {p} above it: {problem}"
    final = parent / d.name
    return final, _problem(_make_private(final), "dir")


def cache_dir(root: Optional[pathlib.Path] = None) -> Optional[pathlib.Path]:
    """The private directory compiled kernels live in (``~/.cache/bitscom`` by default); None, with a warning,
    when another user could replace it or a directory above it (``docs/format.md``, "The kernel cache")."""
    d = pathlib.Path.home() / ".cache" / "bitscom" if root is None else pathlib.Path(root)
    d = pathlib.Path(os.path.abspath(d))
    try:
        d, problem = _walk(d)
    except OSError as err:
        problem = f"it cannot be created ({err})"
    if problem:
        warnings.warn(f"bitscom: not using the kernel cache {d}: {problem}; CPU quantization uses the "
                      "slower eager torch path (fix the directory or remove it)")
        return None
    return d


def _sha256(path) -> str:
    return hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()


def _trusted(lib: pathlib.Path, digest: pathlib.Path) -> bool:
    """Whether the cached library is ours and intact (both files private, the hash recorded)."""
    try:
        if _problem(os.lstat(lib), "file") or _problem(os.lstat(digest), "file"):
            return False
        return digest.read_text().strip() == _sha256(lib)
    except OSError:
        return False


def _write_atomic(path: pathlib.Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _build_and_load(cxx: str, flags: list, d: pathlib.Path):
    src = SOURCE.read_bytes()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256(b"\0".join([src, " ".join(flags).encode(), version.encode(), _cpu_id().encode(),
                                     sys.platform.encode()])).hexdigest()[:20]
    lib = d / f"bitscom_quant_cpu_{key}.so"
    digest = d / f"bitscom_quant_cpu_{key}.sha256"
    if _trusted(lib, digest):
        return ctypes.CDLL(str(lib))
    # Build into a file only this process created (mkstemp), load it, then publish it (docs/format.md).
    fd, tmp = tempfile.mkstemp(prefix=lib.name + ".", suffix=".so", dir=d)
    os.close(fd)
    try:
        proc = subprocess.run([cxx, *BASE_FLAGS, *flags, str(SOURCE), "-o", tmp], capture_output=True,
                              text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr[-2000:])
        handle = ctypes.CDLL(tmp)
        _write_atomic(digest, _sha256(tmp))
        os.replace(tmp, lib)
        return handle
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load(root: Optional[pathlib.Path] = None):
    """Compile (once per machine) and load the native library from :func:`cache_dir`; None,
    with a warning, when that is not possible."""
    if not SOURCE.exists():
        return None
    cxx = compiler()
    if cxx is None:
        warnings.warn("bitscom: no C++ compiler found; CPU quantization uses the slow eager torch path")
        return None
    d = cache_dir(root)
    if d is None:
        return None
    errors = []
    for flags in FLAG_SETS:
        try:
            lib = _build_and_load(cxx, flags, d)
            break
        except (RuntimeError, OSError, subprocess.SubprocessError) as e:
            errors.append(str(e))
    else:
        warnings.warn("bitscom: building the native CPU quantization loop failed; using the slow eager "
                      "torch path. Compiler output:\n" + "\n".join(errors)[-2000:])
        return None
    for name, argtypes in {**_REQUIRED, **_OPTIONAL}.items():
        fn = getattr(lib, name) if name in _REQUIRED else getattr(lib, name, None)
        if fn is not None:
            fn.argtypes, fn.restype = argtypes, _I32
    return lib


@functools.lru_cache(maxsize=None)
def _lib():
    """The process-wide library (None when unavailable)."""
    return load()


def available() -> bool:
    """True when the compiled library loads (compiling it on the first call)."""
    return _lib() is not None


def _has(symbol: str) -> bool:
    """True when the loaded library has the optional kernel ``symbol`` (the real source always does)."""
    return available() and getattr(_lib(), symbol, None) is not None


has_quantize_ef = functools.partial(_has, "bq_quantize_ef")   # quantize_ef()
has_scatter = functools.partial(_has, "bq_scatter")           # scatter()
has_topk = functools.partial(_has, "bq_topk")                 # topk()
has_lowrank = functools.partial(_has, "bq_lr_product")        # lowrank_project(), lowrank_product()


def _check(rc, flag: bool = False) -> bool:
    """Raise unless the kernel's status is 0 or, with ``flag``, 1 (some value was not finite: True)."""
    if rc != 0 and not (flag and rc == 1):
        raise RuntimeError(f"native quantization kernel failed with code {rc}")
    return rc == 1


def quantize_pack(x, bits, block_size, stochastic, seed, index_offset, payload, scales):
    k1, k2 = fmt.seed_keys(seed)
    _check(_lib().bq_quantize(x.data_ptr(), x.numel(), bits, block_size, int(stochastic), k1, k2,
                              index_offset, payload.data_ptr(), scales.data_ptr()))
    return payload, scales


def quantize_ef(grad, residual, bits, block_size, stochastic, seed, index_offset, payload, scales):
    """Error feedback fused into :func:`quantize_pack`, one pass: ``x = residual + grad``, ``C(x)``
    into ``payload``/``scales``, ``residual = x - D(C(x))`` with NaN/Inf set to 0 (the same bits
    as those four steps apart); contiguous CPU tensors, ``grad``/``residual`` float32 alike."""
    if grad.numel() != residual.numel():
        raise ValueError(f"quantize_ef: grad has {grad.numel()} elements, residual {residual.numel()}")
    k1, k2 = fmt.seed_keys(seed)
    _check(_lib().bq_quantize_ef(grad.data_ptr(), residual.data_ptr(), grad.numel(), bits, block_size,
                                 int(stochastic), k1, k2, index_offset, payload.data_ptr(), scales.data_ptr()))
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


def sign_encode(x, counts, bits, scales, update, grad=None):
    """SignSGD's record of the contiguous fp32 ``x`` in one pass: sign bits into the zeroed uint8
    ``bits``, one fp32 scale per segment of the int64 ``counts`` into the uint8 ``scales``; first
    ``x += grad`` when ``grad`` is given, and ``x -= sign * scale`` with ``update`` (error feedback)."""
    _check(_lib().bq_sign_encode(x.data_ptr(), None if grad is None else grad.data_ptr(), x.numel(),
                                 counts.data_ptr(), counts.numel(), bits.data_ptr(), scales.data_ptr(),
                                 int(update)))


def sign_decode_sum(rows, numel, nbytes, counts, out, divide=0) -> bool:
    """``out = Σ_r sign_r · scale_r`` over the rows of the gathered uint8 ``rows`` (rank order),
    then ``out /= divide`` when ``divide`` > 0 (fused); True when some scale is not finite."""
    return _check(_lib().bq_sign_decode_sum(rows.data_ptr(), rows.stride(0), rows.shape[0], numel, nbytes,
                                             counts.data_ptr(), counts.numel(), out.data_ptr(), float(divide)),
                  flag=True)


def scatter(out, indices, values, subtract=False) -> bool:
    """``out[indices] += values`` (``-=`` with ``subtract``) for unique int32/int64 ``indices``,
    contiguous CPU tensors: the bits of ``index_put_`` without its temporaries. Returns whether
    some value was NaN or Inf (adding only; False when subtracting)."""
    return _check(_lib().bq_scatter(out.data_ptr(), out.numel(), indices.data_ptr(),
                                    int(indices.element_size() == 8), values.data_ptr(), values.numel(),
                                    int(subtract)), flag=True)


def topk(x, k, subtract_from=None):
    """``(values, indices)`` of the ``k`` entries of largest ``|x|`` of the contiguous fp32 CPU
    ``x`` (``1 <= k <= x.numel() <= TOPK_MAX_NUMEL``), indices int64 ascending: the set of
    ``x.abs().topk(k)`` (NaN largest; ties to the lower index), exact and deterministic in about
    one pass (see ``bq_topk`` in quant_cpu.cpp). With ``subtract_from`` (fp32 of ``x``'s size,
    possibly ``x``), ``subtract_from[indices] -= values`` in the same pass, as ``index_put_``."""
    import torch
    if subtract_from is not None and subtract_from.numel() != x.numel():
        raise ValueError(f"topk: subtract_from has {subtract_from.numel()} elements, x {x.numel()}")
    indices = torch.empty(k + 1, dtype=torch.int64)     # the kernel writes one entry past k
    values = torch.empty(k + 1, dtype=torch.float32)
    _check(_lib().bq_topk(x.data_ptr(), x.numel(), k, indices.data_ptr(), values.data_ptr(),
                          None if subtract_from is None else subtract_from.data_ptr()))
    return values[:k], indices[:k]


def lowrank_project(mat_ptr: int, n: int, m: int, factor, out, transpose: bool, subtract: bool,
                    grad_ptr: Optional[int] = None) -> None:
    """One matrix of a low-rank group: ``out = M @ factor`` (P = M Q) or, with ``transpose``,
    ``out = Mᵀ @ factor`` (Q = Mᵀ P); first ``M += grad`` with ``grad_ptr``, then ``M -= P Qᵀ`` with
    ``subtract`` (error feedback, while each row is in cache). ``mat_ptr`` addresses a row-major
    n × m fp32 matrix; ``factor``/``out`` are contiguous fp32 (·, r), 1 <= r <= LOWRANK_MAX_RANK.
    Local results (FMA, partial sums): the bits may differ from BLAS's and between CPU models."""
    fn = _lib().bq_lr_project_q if transpose else _lib().bq_lr_project_p
    _check(fn(mat_ptr, n, m, factor.data_ptr(), factor.shape[-1], out.data_ptr(), int(subtract),
              grad_ptr))


def lowrank_product(out_ptr: int, n: int, m: int, p, q) -> None:
    """``out = P Qᵀ`` for one row-major n × m fp32 matrix at ``out_ptr`` from contiguous fp32 ``p``
    (n × r) and ``q`` (m × r), summed left to right without FMA, so every CPU writes the same bits
    from the same factors (what keeps replicas identical)."""
    _check(_lib().bq_lr_product(out_ptr, n, m, p.data_ptr(), q.data_ptr(), p.shape[-1]))
