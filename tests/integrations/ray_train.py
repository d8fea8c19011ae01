"""Ray Train + bitscom: `python ray_train.py` starts Ray on this machine and 2 CPU workers.
Ray initializes torch.distributed in every worker before train_func runs; bitscom.init()
adopts that group. The second run makes "lowbit" the workers' backend (TorchConfig)."""
import hashlib
import os
import tempfile

import ray
import torch
import torch.distributed as dist
import torch.nn as nn
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer, prepare_model

import bitscom


def make_model_and_data():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    data = torch.utils.data.TensorDataset(torch.randn(64, 32), torch.randn(64, 4))
    return model, data


def train(model, opt, data):
    """One epoch over this rank's half of the data, batches of 8; the loss on all of it."""
    def full_loss():
        with torch.no_grad():
            return nn.functional.mse_loss(model(data.tensors[0]), data.tensors[1]).item()

    before = full_loss()
    mine = torch.utils.data.Subset(data, range(dist.get_rank(), len(data), dist.get_world_size()))
    for x, y in torch.utils.data.DataLoader(mine, batch_size=8):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return before, full_loss()


def record(name, model, losses, stats):
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    return (f"{name}: RESULT rank={dist.get_rank()} loss={losses[0]:.4f}->{losses[1]:.4f} "
            f"sent={stats['step_bytes_sent']} fp32={stats['step_dense_bytes']} "
            f"ratio={stats['compression_ratio']:.2f} params={digest}")


def write_records(records, path):
    """Every rank's records, written by rank 0 for the driver to print (Ray Train 2.x keeps
    ray.train.report's metrics only with a checkpoint)."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, records)
    if dist.get_rank() == 0:
        with open(path, "w") as f:
            f.writelines(line + "\n" for lines in everyone for line in lines)


def train_func(config):
    bitscom.init()                               # adopts the process group Ray started
    records = []

    # 1. No DDP: DistributedOptimizer reduces the gradients.
    model, data = make_model_and_data()
    bitscom.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = bitscom.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                       named_parameters=model.named_parameters(),
                                       compression=bitscom.compressors.LowBit(bitwidth=4))
    records.append(record("optimizer", model, train(model, opt, data), opt.comm_stats()))
    opt.close()

    # 2. Ray's DDP (prepare_model), its all-reduce compressed by the comm hook.
    model, data = make_model_and_data()
    ddp = prepare_model(model)                   # DistributedDataParallel with 2+ workers
    state, hook = bitscom.ddp_comm_hook(bitscom.compressors.PowerSGD(rank=2, start_iter=0))
    ddp.register_comm_hook(state, hook)          # before the first backward
    losses = train(ddp, torch.optim.SGD(ddp.parameters(), lr=0.05), data)
    records.append(record("ddp_hook", model, losses, state.comm_stats()))
    state.close()
    write_records(records, config["out"])


def lowbit_func(config):
    """Plain DDP (no hook) on the "lowbit" world backend: its all-reduce runs in 4 bits."""
    bitscom.init()                               # adopts the lowbit world Ray started
    model, data = make_model_and_data()
    ddp = prepare_model(model)
    losses = train(ddp, torch.optim.SGD(ddp.parameters(), lr=0.05), data)
    stats = dist.group.WORLD.comm_stats()        # the LowBitProcessGroup's own byte count
    write_records([record(f"backend={dist.get_backend()}", model, losses, stats)], config["out"])


def register_lowbit():
    """Ray runs this in every worker process as it starts, before Ray's init_process_group."""
    bitscom.register_lowbit_backend(bitwidth=4)


def fit(func, storage, name, backend):
    """``func`` on 2 CPU workers with ``backend``; prints the records it wrote."""
    out = os.path.join(storage, f"{name}.txt")
    TorchTrainer(func, train_loop_config={"out": out}, torch_config=TorchConfig(backend=backend),
                 scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
                 run_config=RunConfig(storage_path=storage, name=name)).fit()
    with open(out) as f:
        print(f.read(), end="", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")     # read by ray.init: nothing to send
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=100 * 2**20,
             runtime_env={"worker_process_setup_hook": register_lowbit})
    with tempfile.TemporaryDirectory(prefix="bitscom_ray_") as storage:
        fit(train_func, storage, "gloo", "gloo")
        fit(lowbit_func, storage, "lowbit", "lowbit")
    ray.shutdown()
