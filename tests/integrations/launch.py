"""Start a recipe script on 2 CPU ranks with a hang limit, and read back its RESULT records.

Two ways, as users start them: ``run_ranks`` starts every rank itself with torchrun's
variables (what ``torchrun`` / ``accelerate launch`` do); ``run_self_launching`` starts one
process that launches the others (Lightning's ``devices=2``). Either kills every process it
started when the limit passes or a rank fails, so a hang costs the limit, not the suite.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK",
               "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE",
               "SLURM_NTASKS", "SLURM_JOB_ID")
RECORD = re.compile(r"RESULT rank=(\d+) loss=(\S+)->(\S+) sent=(\d+) fp32=(\d+) ratio=\S+ params=([0-9a-f]{64})")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()))
    return env


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)       # the process and whatever it started
    except ProcessLookupError:
        pass
    proc.wait()


def run_ranks(script: str, world: int = 2, timeout: float = 150) -> list:
    """Each rank's combined output; asserts every rank exited 0 within ``timeout`` seconds."""
    env = base_env()
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, script)], cwd=HERE,
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world),
                                       LOCAL_WORLD_SIZE=str(world)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True)
             for r in range(world)]
    outs = []
    try:
        for proc in procs:
            outs.append(proc.communicate(timeout=timeout)[0])
    except subprocess.TimeoutExpired:
        for proc in procs:
            _kill(proc)
        raise AssertionError(f"{script} did not finish within {timeout} s (hung?)") from None
    for r, proc in enumerate(procs):
        assert proc.returncode == 0, f"{script} rank {r} exited {proc.returncode}:\n{outs[r][-4000:]}"
    return outs


def run_self_launching(script: str, timeout: float = 150, env: Optional[dict] = None) -> str:
    """The output of ``python script`` (which starts its other ranks itself, in its session);
    ``env``: variables set on top of :func:`base_env`."""
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, script)], cwd=HERE, env=dict(base_env(), **(env or {})),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out = proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        _kill(proc)
        raise AssertionError(f"{script} did not finish within {timeout} s (hung?)") from None
    if proc.returncode != 0:
        _kill(proc)
        raise AssertionError(f"{script} exited {proc.returncode}:\n{out[-4000:]}")
    return out


def records(text: str, world: int = 2) -> list:
    """``(rank, loss_before, loss_after, bytes_sent, dense_bytes, digest)`` per rank, by rank;
    matched as records because ranks sharing one pipe can run their lines together."""
    found = sorted((int(r), float(a), float(b), int(s), int(d), h) for r, a, b, s, d, h in RECORD.findall(text))
    assert [f[0] for f in found] == list(range(world)), f"expected one RESULT per rank:\n{text[-4000:]}"
    return found
