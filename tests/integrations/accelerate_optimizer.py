"""Accelerate for launching and data sharding, bitscom.DistributedOptimizer for the gradients
(no DDP): run with
`torchrun --nproc_per_node 2 accelerate_optimizer.py` (on GPUs also `accelerate launch --multi_gpu --num_processes 2`)."""
import hashlib

import torch
import torch.nn as nn
from accelerate import Accelerator

import bitscom

accelerator = Accelerator(cpu=True)          # drop cpu=True on GPUs
bitscom.init()                               # adopts the process group Accelerate started

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)).to(accelerator.device)
data = torch.utils.data.TensorDataset(torch.randn(64, 32), torch.randn(64, 4))
loader = accelerator.prepare(torch.utils.data.DataLoader(data, batch_size=8))   # the data only

bitscom.broadcast_parameters(model.state_dict(), root_rank=0)   # what DDP would have done
opt = bitscom.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters(),
                                   compression=bitscom.compressors.LowBit(bitwidth=4))


def full_loss():
    x, y = (t.to(accelerator.device) for t in data.tensors)
    with torch.no_grad():
        return nn.functional.mse_loss(model(x), y).item()


before = full_loss()
for x, y in loader:                          # each rank gets its own batches
    opt.zero_grad()
    accelerator.backward(nn.functional.mse_loss(model(x), y))
    opt.step()

stats = opt.comm_stats()                     # the last step's bytes, this rank
digest = hashlib.sha256(b"".join(p.detach().cpu().numpy().tobytes()
                                 for p in model.parameters())).hexdigest()
print(f"RESULT rank={accelerator.process_index} loss={before:.4f}->{full_loss():.4f} "
      f"sent={stats['step_bytes_sent']} fp32={stats['step_dense_bytes']} "
      f"ratio={stats['compression_ratio']:.2f} params={digest}", flush=True)
opt.close()

# What not to do: a model that went through prepare() is wrapped in DDP, which already
# all-reduces its gradients in fp32; DistributedOptimizer refuses it instead of reducing twice.
wrapped = accelerator.prepare(nn.Linear(4, 4))
try:
    bitscom.DistributedOptimizer(torch.optim.SGD(wrapped.parameters(), lr=0.05),
                                 named_parameters=wrapped.named_parameters())
except TypeError as err:
    print(f"REFUSED rank={accelerator.process_index} {err}", flush=True)
accelerator.end_training()
