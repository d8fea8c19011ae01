"""Measure the bytes of bitscom.fsdp's low-bit parameter all-gather (docs/fsdp.md, "Measured").

Two gloo ranks on this machine, an MLP 256-1024-1024-256 (1.58 M parameters, each Linear and
the root ``fully_shard``-ed with ``reshard_after_forward=False``), AdamW, 4-bit gradients; for
each weight scheme the bytes of steps 2-5 from ``handle.comm_stats()``.

    python scripts/fsdp_weights_bytes.py
"""

import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

SCHEMES = {"8-bit blockwise (qwZ)": {}, "4-bit difference (SDP4Bit qWD)": {"mode": "difference"}}
KEYS = ("all_gather_bytes_sent", "all_gather_dense_bytes", "all_gather_compression_ratio", "all_gathers",
        "compression_ratio")


def _rank(rank: int, port: int, queue) -> None:
    import bitscom.fsdp
    from bitscom.fsdp import WeightConfig
    from bitscom.lowbit import LowBitConfig
    from torch.distributed.fsdp import fully_shard
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    for name, kwargs in SCHEMES.items():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 1024), nn.GELU(),
                              nn.Linear(1024, 256))
        for m in model:
            if isinstance(m, nn.Linear):
                fully_shard(m, reshard_after_forward=False)
        fully_shard(model, reshard_after_forward=False)
        handle = bitscom.fsdp.compress(model, gradients=LowBitConfig(bitwidth=4), weights=WeightConfig(**kwargs))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(rank)
        for step in range(5):
            x = torch.randn(32, 256, generator=g)
            ((model(x) - x.tanh()) ** 2).mean().backward()
            opt.step()
            opt.zero_grad()
            if step == 0:
                handle.reset_stats()
        if rank == 0:
            stats = handle.comm_stats()
            queue.put((name, {k: stats[k] for k in KEYS}))
    dist.destroy_process_group()


def main() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    for _ in SCHEMES:
        name, stats = queue.get(timeout=600)
        print(f"{name}: " + ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                                      for k, v in stats.items()))
    for p in procs:
        p.join()
    return max(p.exitcode or 0 for p in procs)


if __name__ == "__main__":
    sys.exit(main())
