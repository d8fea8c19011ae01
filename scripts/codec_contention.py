"""How much a codec costs when one rank times it alone vs when every rank runs at once.

Why: ``compression="auto"`` decides with codec times measured during training. Timed by rank 0
alone while the other ranks wait in a collective, a rank has the machine's cores to itself; in
a step every rank runs its codec at the same moment. Where ranks share cores (this 2-core
machine with 4 ranks, or a GPU node whose CPU feeds several ranks), the two differ. This script
measures both for one BERT-sized bucket (7.1 M elements: two 768x3072 and four 768x768
matrices plus two bias vectors) and every compressor auto may choose with SGD.

    torchrun --nproc_per_node 4 scripts/codec_contention.py          # 4 ranks on this machine
    torchrun --nproc_per_node 2 scripts/codec_contention.py --threads 1

Prints one row per compressor: rank 0 alone (minimum of 3 runs, what auto measured before
2026-12-03) and all ranks at once (median of 3 runs, the slowest rank; what it measures now).
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist

import bitscom
from bitscom.cost.auto import SGD_SAFE
from bitscom.cost import layout_of, time_codec

SHAPES = [(768, 3072), (3072, 768), (768, 768), (768, 768), (768, 768), (768, 768), (3072,), (768,)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    bitscom.init()
    rank, world = bitscom.rank(), bitscom.size()
    numel = sum(torch.Size(s).numel() for s in SHAPES)
    layout = layout_of(numel, shapes=SHAPES)
    grad = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    rows = []
    for comp in SGD_SAFE[1:]:                       # every candidate but the plain all-reduce
        dist.barrier()
        alone = time_codec(comp, layout, world, grad) if rank == 0 else 0.0   # others wait
        dist.barrier()
        together = torch.tensor([time_codec(comp, layout, world, grad, statistic=statistics.median)])
        dist.all_reduce(together, op=dist.ReduceOp.MAX)
        rows.append((comp.name, getattr(comp, "rank", ""), alone, float(together)))
    if rank == 0:
        print(f"{world} ranks, {a.threads} thread(s) each, one bucket of {numel} elements")
        print(f"{'compressor':<12} {'rank 0 alone (ms)':>18} {'all at once (ms)':>17} {'ratio':>6}")
        for name, r, alone, together in rows:
            label = f"{name} r{r}" if r != "" else name
            print(f"{label:<12} {alone * 1e3:>18.1f} {together * 1e3:>17.1f} {together / alone:>5.2f}x")
    bitscom.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
