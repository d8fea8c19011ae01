"""The ACP-SGD authors' imagenet_benchmark.py / bert_benchmark.py usage pattern, CPU-patched.

Their calls in their order: ``dist.init_process_group`` by the script, ``hvd.size()`` for the
LR scale, ``if hvd.size() > 1: optimizer = hvd.DistributedOptimizer(optimizer, rank=...)``
*before* ``hvd.broadcast_parameters``, a ``timeit`` benchmark loop, ``hvd.rank()`` in the
logger. ``--positional`` uses the ``(optimizer, named_parameters, rank, threshold)`` form.
CPU patch: gloo, a small MLP on fixed random data, no ``torch.cuda.synchronize()``.
"""
import argparse
import hashlib
import os
import timeit

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.optim as optim

import acpsgd as hvd

parser = argparse.ArgumentParser()
parser.add_argument('--batch-size', type=int, default=16)
parser.add_argument('--num-warmup-batches', type=int, default=2)
parser.add_argument('--num-batches-per-iter', type=int, default=3)
parser.add_argument('--num-iters', type=int, default=2)
parser.add_argument('--rank', type=int, default=2)
parser.add_argument('--positional', action='store_true', default=False)
args = parser.parse_args()

dist.init_process_group(backend='gloo', init_method='env://')
args.local_rank = int(os.environ['LOCAL_RANK'])
torch.manual_seed(0)
torch.set_num_threads(1)

model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128),
                            torch.nn.ReLU(), torch.nn.Linear(128, 10))
if hvd.rank() == 1:
    torch.nn.init.zeros_(model[0].weight)        # replicas start different; broadcast fixes it
lr_scaler = hvd.size()
optimizer = optim.SGD(model.parameters(), lr=0.01 * lr_scaler)

g = torch.Generator().manual_seed(100 + hvd.rank())
data = torch.randn(args.batch_size, 64, generator=g)
target = torch.randint(0, 10, (args.batch_size,), generator=g)

if hvd.size() > 1:
    if args.positional:
        optimizer = hvd.DistributedOptimizer(optimizer, model.named_parameters(), args.rank, 0)
    else:
        optimizer = hvd.DistributedOptimizer(optimizer, rank=args.rank)

if hvd.size() > 0:
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)


def benchmark_step():
    optimizer.zero_grad()
    output = model(data)
    loss = F.cross_entropy(output, target)
    loss.backward()
    optimizer.step()


def log(s, nl=True):
    if hvd.rank() != 0:
        return
    print(s, end='\n' if nl else '')


log('Number of CPUs: %d' % hvd.size())
log('Running warmup...')
timeit.timeit(benchmark_step, number=args.num_warmup_batches)
log('Running benchmark...')
img_secs = []
for x in range(args.num_iters):
    time = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
    img_secs.append(args.batch_size * args.num_batches_per_iter / time)
    log('Iter #%d: %.1f img/sec per CPU' % (x, img_secs[-1]))
log('Img/sec per CPU: %.1f' % np.mean(img_secs))
digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes()
                                 for p in model.parameters())).hexdigest()
print(f"DIGEST rank={hvd.rank()} rank_r={optimizer.compression.rank} "
      f"buckets={len(optimizer.bucket_layouts)} {digest}", flush=True)
