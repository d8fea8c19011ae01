"""bitscom.init: launcher discovery, node groups, failure of a rank, mpirun and torchrun launches."""

import os
import re
import shutil
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

import bitscom
from bitscom.runtime import discover
from distpool import RankError, WorkerPool

HERE = os.path.dirname(os.path.abspath(__file__))


def test_discover_torchrun():
    info = discover({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                     "MASTER_ADDR": "h0", "MASTER_PORT": "1234"})
    assert (info.rank, info.size, info.local_rank, info.local_size, info.launcher) == (3, 4, 1, 2, "torchrun")
    assert (info.master_addr, info.master_port) == ("h0", 1234)


def test_discover_openmpi_mpich_slurm_and_none():
    ompi = discover({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8",
                     "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"})
    assert (ompi.rank, ompi.size, ompi.local_rank, ompi.local_size, ompi.launcher) == (5, 8, 1, 4, "mpi")
    mpich = discover({"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"})
    assert (mpich.rank, mpich.size, mpich.local_rank, mpich.local_size) == (2, 4, 0, 2)
    slurm = discover({"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1",
                      "SLURM_NTASKS_PER_NODE": "2", "SLURM_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "77"})
    assert (slurm.rank, slurm.size, slurm.local_rank, slurm.local_size) == (3, 4, 1, 2)
    assert slurm.master_addr == "gpu07" and slurm.master_port == 29577
    none = discover({})
    assert (none.rank, none.size, none.launcher) == (0, 1, "none")


def _groups(rank, world):
    info = bitscom.init()  # second call: harmless, same answer
    intra, inter = bitscom.intra_group(), bitscom.inter_group()
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=intra)
    u = torch.tensor([float(rank)])
    dist.all_reduce(u, group=inter)
    return (info.rank, bitscom.rank(), bitscom.size(), bitscom.local_rank(), bitscom.local_size(),
            bitscom.cross_rank(), bitscom.cross_size(), t.item(), u.item())


def test_fake_two_nodes_groups(pools):
    res = pools.run(4, _groups)
    # ranks 0,1 on node 0 and 2,3 on node 1; inter groups {0,2} and {1,3}
    assert [r[:7] for r in res] == [(0, 0, 4, 0, 2, 0, 2), (1, 1, 4, 1, 2, 0, 2),
                                    (2, 2, 4, 0, 2, 1, 2), (3, 3, 4, 1, 2, 1, 2)]
    assert [r[7] for r in res] == [1.0, 1.0, 5.0, 5.0]
    assert [r[8] for r in res] == [2.0, 4.0, 2.0, 4.0]


def _dies(rank, world):
    from helpers import global_batch, make_model, shard
    model = make_model()
    opt = bitscom.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters())
    x, y = global_batch(0, world)
    loss = torch.nn.functional.mse_loss(model(shard(x, rank, world)), shard(y, rank, world))
    loss.backward()
    opt.step()  # step 0 completes on both ranks
    loss = torch.nn.functional.mse_loss(model(shard(x, rank, world)), shard(y, rank, world))
    if rank == 1:
        os._exit(3)  # dies mid-step, before its gradients reach anyone
    start = time.time()
    try:
        loss.backward()
        opt.step()
    except RuntimeError as err:
        return f"raised after {time.time() - start:.1f}s: {err}"
    return "no error"


def test_rank_death_raises_instead_of_hanging():
    pool = WorkerPool(2)
    try:
        with pytest.raises(RankError) as info:
            pool.run(_dies, timeout=90)
    finally:
        pool.close()
    text = str(info.value)
    assert "rank 1: worker process died" in text
    assert "hang" not in text, text


def _mpi_or_torchrun_result():
    env = dict(os.environ, PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    return env


def _read_result(out: str):
    # ranks share one stdout pipe, so lines can run together: match records, not lines
    lines = re.findall(r"RESULT rank=\d+ launcher=\S+ world=\d+ local=\S+ [0-9a-f]{64}", out)
    assert len(lines) == 2, out
    return sorted(lines)


@pytest.fixture(scope="module")
def torchrun_result():
    """One torchrun launch of tests/launch_script.py, shared by the tests that compare with it."""
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--standalone", os.path.join(HERE, "launch_script.py")],
                          env=_mpi_or_torchrun_result(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return _read_result(proc.stdout)


def test_torchrun_launch(torchrun_result):
    assert torchrun_result[0].split()[-1] == torchrun_result[1].split()[-1], "replicas differ"


def _mpirun():
    exe = shutil.which("mpirun")
    if exe is None:
        bindir = os.path.join(os.path.dirname(sys.executable))
        cand = os.path.join(bindir, "mpirun")
        exe = cand if os.path.exists(cand) else None
    return exe


@pytest.mark.skipif(_mpirun() is None, reason="no mpirun: install the 'mpi' extra (pip install -e .[mpi])")
def test_mpirun_launch_matches_torchrun(torchrun_result):
    pytest.importorskip("mpi4py")
    env = _mpi_or_torchrun_result()
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.run([_mpirun(), "--allow-run-as-root", "--oversubscribe", "--map-by", "slot",
                           "-np", "2", sys.executable, os.path.join(HERE, "launch_script.py")],
                          env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    mpi = _read_result(proc.stdout)
    assert "launcher=mpi" in mpi[0] and "launcher=mpi" in mpi[1]
    assert [l.split()[3:] for l in mpi] == [l.split()[3:] for l in torchrun_result]
