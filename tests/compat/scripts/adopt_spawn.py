"""A process group started with mp.spawn + init_process_group (no launcher variables), then
bitscom used without bitscom.init(): the group is adopted on first use."""
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def main(rank, world, port):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    import bitscom
    import acpsgd
    first = (bitscom.is_initialized(), bitscom.rank(), bitscom.size(), bitscom.local_rank(),
             bitscom.local_size(), acpsgd.rank(), acpsgd.size())
    try:
        bitscom.intra_group()
        node_error = "none"
    except RuntimeError as err:
        node_error = str(err)
    total = bitscom.allreduce(torch.tensor([rank + 1.0]), op=bitscom.Sum).item()
    bitscom.init()                           # every rank: completes init on the adopted group
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=bitscom.intra_group())
    print(f"RESULT rank={rank} first={first} total={total} intra_sum={t.item()} "
          f"node_error={'init()' in node_error}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(main, args=(2, int(sys.argv[1])), nprocs=2)
