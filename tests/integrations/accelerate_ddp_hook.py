"""Accelerate + bitscom's DDP comm hook: run with
`torchrun --nproc_per_node 2 accelerate_ddp_hook.py` (on GPUs also `accelerate launch --multi_gpu --num_processes 2`)."""
import hashlib

import torch
import torch.nn as nn
from accelerate import Accelerator
from torch.nn.parallel import DistributedDataParallel as DDP

import bitscom

accelerator = Accelerator(cpu=True)          # drop cpu=True on GPUs
bitscom.init()                               # adopts the process group Accelerate started

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
data = torch.utils.data.TensorDataset(torch.randn(64, 32), torch.randn(64, 4))
loader = torch.utils.data.DataLoader(data, batch_size=8)

model, opt, loader = accelerator.prepare(model, opt, loader)
assert isinstance(model, DDP), "start 2+ processes: prepare() wraps in DDP only then"
state, hook = bitscom.ddp_comm_hook(bitscom.compressors.LowBit(bitwidth=4))
model.register_comm_hook(state, hook)        # before the first backward


def full_loss():
    x, y = (t.to(accelerator.device) for t in data.tensors)
    with torch.no_grad():
        return nn.functional.mse_loss(model(x), y).item()


before = full_loss()
for x, y in loader:                          # each rank gets its own batches
    opt.zero_grad()
    accelerator.backward(nn.functional.mse_loss(model(x), y))
    opt.step()

stats = state.comm_stats()                   # step_*: the last iteration's, this rank
digest = hashlib.sha256(b"".join(p.detach().cpu().numpy().tobytes()
                                 for p in model.parameters())).hexdigest()
print(f"RESULT rank={accelerator.process_index} loss={before:.4f}->{full_loss():.4f} "
      f"sent={stats['step_bytes_sent']} fp32={stats['step_dense_bytes']} "
      f"ratio={stats['compression_ratio']:.2f} params={digest}", flush=True)
state.close()
accelerator.end_training()
