"""CUDA AMP through DistributedOptimizer: fp16 autocast + GradScaler, unscale, clip, step.

Run by scripts/gpu_check.sh on a GPU machine (torchrun, NCCL). The CPU tests run this loop on
gloo ranks with GradScaler("cpu"); this runs it with CUDA fp16 autocast: GradScaler's unscale and
inf check on the optimizer subclass, an injected Inf skipping the step, parameters staying finite.
With one GPU (one rank) the reduction itself is a no-op; with N GPUs (--nproc_per_node N) every
rank must skip the same step, which the Inf fed to rank 0 only tests.

    python -m torch.distributed.run --standalone --nproc_per_node 1 scripts/gpu_amp_check.py
"""

import torch

import bitscom


def main() -> None:
    bitscom.init()
    dev = bitscom.runtime.device()
    assert dev.type == "cuda", f"needs a GPU, got {dev}"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)).to(dev)
    opt = bitscom.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       model.named_parameters(), compression="lowbit")
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 10)
    skipped = 0
    for step in range(20):
        x = torch.randn(32, 64, device=dev)
        y = torch.randint(0, 10, (32,), device=dev)
        if step == 5 and bitscom.rank() == 0:          # an overflow on one rank: all must skip
            x[0, 0] = float("inf")
        opt.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        before = [p.detach().clone() for p in model.parameters()]
        scale = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        moved = any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
        if scaler.get_scale() < scale:
            skipped += 1
            assert not moved, f"step {step}: GradScaler skipped but parameters moved"
        assert all(torch.isfinite(p).all() for p in model.parameters()), f"step {step}: non-finite"
    assert skipped >= 1, "the injected Inf was not seen by GradScaler"
    print(f"gpu_amp_check: ok (rank {bitscom.rank()}/{bitscom.size()}, {skipped} skipped step(s), "
          f"last loss {loss.item():.4f}, {opt.comm_stats()})")


if __name__ == "__main__":
    main()
