"""Trains 3 steps under whatever launcher started it and prints a digest of the parameters."""

import hashlib

import torch
import torch.nn as nn

import bitscom
from helpers import global_batch, make_model, shard

torch.set_num_threads(1)
info = bitscom.init()
rank, world = bitscom.rank(), bitscom.size()
model = make_model(seed=rank)  # different init per rank: broadcast must fix it
bitscom.broadcast_parameters(model.state_dict(), root_rank=0)
opt = bitscom.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(), fusion_threshold_mb=0.0005)
for step in range(3):
    opt.zero_grad()
    x, y = global_batch(step, world)
    nn.functional.mse_loss(model(shard(x, rank, world)), shard(y, rank, world)).backward()
    opt.step()
digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
print(f"RESULT rank={rank} launcher={info.launcher} world={world} "
      f"local={bitscom.local_rank()}/{bitscom.local_size()} {digest}", flush=True)
bitscom.shutdown()
