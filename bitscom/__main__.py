"""``python -m bitscom``: what this machine gives bitscom, for bug reports and first runs.

Like ``python -m torch.utils.collect_env``; it never starts ``torch.distributed``. Example::

    python -m bitscom                      # one "name: value" line per question
    torchrun --nproc_per_node 2 -m bitscom # each rank reports what its launcher told it
"""
from __future__ import annotations

import argparse
import importlib
import os
import shutil
import sys
import sysconfig
import warnings

import torch
import torch.distributed as dist

import bitscom
from bitscom import build_info
from bitscom.runtime import discover

KERNEL_USERS = "lowbit compressor, LowBitGroup, the 'lowbit' backend, ShardedOptimizer"
KERNEL_CODECS = ("lowbit", "exclude")     # exclude wraps another compressor: its codec decides


def _python() -> str:
    venv = sys.prefix != sys.base_prefix
    return f"{sys.version.split()[0]} at {sys.executable}" + (f" (virtual env {sys.prefix})" if venv else "")


def _torch_build() -> str:
    if torch.version.cuda:
        build = f"CUDA {torch.version.cuda} build"
    elif getattr(torch.version, "hip", None):
        build = f"ROCm {torch.version.hip} build"
    else:
        build = "CPU build"
    return f"{torch.__version__} ({build}) at {os.path.dirname(torch.__file__)}"


def _cuda() -> str:
    if not build_info.cuda_built():
        return "no (torch built without CUDA)"
    if not torch.cuda.is_available():
        return "no (CUDA build, but no usable GPU or driver)"
    props = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
    devices = [f"{i}: {p.name} (sm_{p.major}{p.minor}, {p.total_memory / 2**30:.0f} GiB)" for i, p in enumerate(props)]
    return f"yes, {len(devices)} device(s): " + "; ".join(devices)


def _module_version(name: str, hint: str) -> str:
    try:
        mod = importlib.import_module(name)
    except Exception as e:  # ImportError, or a build that cannot find its shared libraries
        return f"not importable ({type(e).__name__}: {str(e)[:80]}); {hint}"
    return f"{getattr(mod, '__version__', '?')} at {os.path.dirname(mod.__file__ or '?')}"


def _program(name: str, hint: str) -> str:
    found = shutil.which(name)
    if found:
        return found
    here = os.path.join(sysconfig.get_path("scripts"), name)
    if os.access(here, os.X_OK):
        return f"not on PATH, but at {here} (activate this environment)"
    return f"not found; {hint}"


def _nccl() -> str:
    if not build_info.nccl_built():
        return "no (torch has no NCCL: CUDA tensors cannot be reduced; use gloo on CPU)"
    version = torch.cuda.nccl.version()
    return "yes, " + (".".join(map(str, version)) if isinstance(version, tuple) else str(version))


def _launcher() -> str:
    info = discover()
    if info.launcher == "none":
        return "none: one process (bitscom.init() would run a world of size 1)"
    where = f", master {info.master_addr}:{info.master_port}" if info.master_addr else ""
    return (f"{info.launcher}: rank {info.rank} of {info.size}, local rank {info.local_rank} "
            f"of {info.local_size}{where}")


def _cpu_kernels() -> str:
    from bitscom.kernels import cpu_native
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ok = cpu_native.available()
    if ok:
        return (f"native: {cpu_native.SOURCE.name} compiled with {cpu_native.compiler()}, "
                f"cached in {cpu_native.cache_dir()}")
    why = str(caught[0].message).splitlines()[0] if caught else "the native library did not load"
    return f"torch (eager reference, slower): {why}"


def _cuda_kernels() -> str:
    from bitscom.kernels import cuda
    device = "" if torch.cuda.is_available() else " (no CUDA device here)"
    if cuda.available():
        return f"cuda: CuPy RawKernels from {cuda.SOURCE.name}, compiled on first launch per device{device}"
    return f"torch (eager reference, slower): CuPy is not importable; pip install -e \".[cuda]\"{device}"


def report() -> list:
    """The report as ``(question, answer)`` pairs, in print order. Example::

        dict(bitscom.__main__.report())["gloo"]   # 'yes'
    """
    return [
        ("bitscom", f"{bitscom.__version__} at {os.path.dirname(bitscom.__file__)}"),
        ("python", _python()),
        ("torch", _torch_build()),
        ("CUDA available", _cuda()),
        ("CuPy", _module_version("cupy", 'pip install -e ".[cuda]" for the CUDA kernels')),
        ("nvcc", _program("nvcc", "not needed: CuPy compiles the kernels with NVRTC")),
        ("NCCL", _nccl()),
        ("gloo", "yes" if build_info.gloo_built() else "no"),
        ("torch MPI backend",
         ("yes" if build_info.mpi_built() else "no") + " (not needed: bitscom uses mpi4py under mpirun)"),
        ("mpi4py", _module_version("mpi4py", 'pip install -e ".[mpi]" to launch with mpirun')),
        ("mpirun", _program("mpirun", 'pip install -e ".[mpi]" or your cluster\'s Open MPI')),
        ("launcher", _launcher()),
        ("low-bit kernels on CPU", _cpu_kernels()),
        ("low-bit kernels on CUDA", _cuda_kernels()),
        ("  used by", KERNEL_USERS),
        ("other codecs", ", ".join(n for n in bitscom.compressors.names() if n not in KERNEL_CODECS)
         + ": torch ops on every device"),
        ("torch.distributed", "initialized" if dist.is_available() and dist.is_initialized()
         else "not initialized (this report never starts it)"),
    ]


def _parser() -> argparse.ArgumentParser:
    return argparse.ArgumentParser(
        prog="python -m bitscom", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Print what this machine gives bitscom, one 'question: answer' line each:\n"
                    "bitscom, Python and torch, CUDA, CuPy, NCCL, gloo, MPI, the launcher and the\n"
                    "low-bit kernel paths. It only looks: it never starts torch.distributed.",
        epilog="examples:\n"
               "  python -m bitscom\n"
               "  torchrun --nproc_per_node 2 -m bitscom   # each rank: what its launcher told it\n\n"
               "A launcher variable that is no valid number (WORLD_SIZE=abc) is one line on\n"
               "stderr naming it, and exit status 2.")


def main(argv=None) -> int:
    """Print :func:`report`, one ``question: answer`` line each (``--help``: the usage)."""
    _parser().parse_args(argv)
    try:
        discover()                   # the launcher's variables, checked before the report reads them
    except ValueError as err:
        print(f"python -m bitscom: error: {err}", file=sys.stderr)
        return 2
    rows = report()
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key + ':':<{width + 1}} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
