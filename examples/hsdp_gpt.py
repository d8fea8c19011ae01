#!/usr/bin/env python3
"""A torchtitan-style training loop: FSDP2 + HSDP + DCP checkpoints + AdamW, with bitscom
compressing the inter-node (replicate) all-reduce.

The parts are the ones torchtitan wires together: a 2-D device mesh (replicate x shard),
``fully_shard`` on every transformer block and the root, ``MixedPrecisionPolicy`` (bf16
parameters in compute, float32 gradient reduction), AdamW, and checkpoints through
``get_state_dict`` + ``dcp.save`` / ``dcp.load`` + ``set_state_dict``. bitscom adds two calls:
``bitscom.fsdp.compress(model, replicate_group=...)`` and one more entry in the checkpoint dict.
The model is a small GPT initialized from code (no download), fed a synthetic language.

Launch (4 ranks = 2 "nodes" x 2 ranks; CPU and gloo work)::

    python -m torch.distributed.run --nproc_per_node 4 examples/hsdp_gpt.py --mesh 2x2 --steps 50
    python -m torch.distributed.run --nproc_per_node 4 examples/hsdp_gpt.py --replicate exact   # native HSDP
    # checkpoint at step 20, then resume from it:
    python -m torch.distributed.run --nproc_per_node 4 examples/hsdp_gpt.py --steps 20 --ckpt /tmp/ck --save-at 20
    python -m torch.distributed.run --nproc_per_node 4 examples/hsdp_gpt.py --steps 40 --ckpt /tmp/ck --resume

``--replicate exact`` is stock FSDP2 native HSDP (``fully_shard`` on the 2-D mesh: FSDP's own
float32 all-reduce across nodes); ``--replicate 4`` (default) shards on ``mesh["shard"]`` and
averages across nodes with bitscom's 4-bit all-reduce with error feedback. ``--mesh 1x2
--weights blockwise`` is plain FSDP2 with the parameter all-gather in 8 bits (``difference``: 4-bit
weight differences); ``--grad-bits 4`` adds the 4-bit reduce-scatter. See docs/fsdp.md.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

import bitscom
import bitscom.fsdp
from bitscom.fsdp import WeightConfig
from bitscom.lowbit import LowBitConfig

VOCAB = 64


class GPT(nn.Module):
    """Token + position embeddings, pre-norm causal transformer blocks, a linear head."""

    def __init__(self, dim: int = 64, layers: int = 2, heads: int = 4, seq: int = 32):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, dim)
        self.pos = nn.Parameter(torch.zeros(seq, dim))
        self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True,
                                                               norm_first=True) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, x):
        n = x.shape[1]
        h = self.tok(x) + self.pos[:n]
        for block in self.blocks:
            h = block(h, src_mask=self.mask[:n, :n].to(h.dtype), is_causal=True)
        # logits of every position as (batch * seq, vocab): a 2-D head output is not a view,
        # which FSDP2 warns about for a root module's output
        return self.head(self.norm(h).reshape(-1, h.shape[-1]))


def batch(step: int, rank: int, size: int = 8, seq: int = 32):
    """A synthetic language (noisy strided walks over the vocabulary), different per rank and step."""
    g = torch.Generator().manual_seed(7919 * step + rank)
    start = torch.randint(0, VOCAB, (size, 1), generator=g)
    stride = torch.randint(1, 5, (size, 1), generator=g)
    seqs = (start + stride * torch.arange(seq + 1)) % VOCAB
    return seqs[:, :-1], seqs[:, 1:]


def parse_mesh(text: str):
    try:
        r, s = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--mesh must look like 2x2 (replicate x shard), got {text!r}") from None
    return r, s


def build(args):
    """Mesh, sharded model, bitscom handle (None for exact), optimizer."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    replicas, shards = parse_mesh(args.mesh)
    if replicas * shards != dist.get_world_size():
        raise SystemExit(f"--mesh {args.mesh} needs {replicas * shards} ranks, this run has {dist.get_world_size()}")
    mesh = init_device_mesh("cpu", (replicas, shards), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(args.seed)                       # every rank builds the same initial model
    model = GPT(args.dim, args.layers)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if args.bf16 else None, reduce_dtype=torch.float32)
    exact = args.replicate == "exact"
    shard_mesh = mesh if exact and replicas > 1 else mesh["shard"]     # native HSDP shards on the 2-D mesh
    for block in model.blocks:
        fully_shard(block, mesh=shard_mesh, mp_policy=policy)
    fully_shard(model, mesh=shard_mesh, mp_policy=policy)
    handle = None
    kw = {} if args.weights == "none" else {"weights": WeightConfig(mode=args.weights)}
    if replicas > 1 and not exact:
        bits = int(args.replicate)
        handle = bitscom.fsdp.compress(model, replicate_group=mesh.get_group("replicate"),
                                       replicate=LowBitConfig(bitwidth=bits, error_feedback=bits < 32 and not args.no_ef),
                                       **kw)
    elif replicas == 1 and (kw or args.grad_bits < 32):      # plain FSDP2: gradients and/or weights
        handle = bitscom.fsdp.compress(model, gradients=LowBitConfig(bitwidth=args.grad_bits,
                                                                     error_feedback=args.grad_bits < 32), **kw)
    elif kw:
        raise SystemExit("--weights with --replicate exact on a 2-D mesh: native HSDP has no hook for it here")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    return model, handle, opt


def checkpoint_entries(model, opt, handle, **kw):
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    if handle is not None:
        state["bitscom"] = bitscom.fsdp.checkpoint_state(handle, **kw)
    return state


def save(path, step, model, opt, handle):
    import torch.distributed.checkpoint as dcp
    state = checkpoint_entries(model, opt, handle)
    state["train"] = {"step": step}
    dcp.save(state, checkpoint_id=path)


def load(path, model, opt, handle, reset_compressor_state=False) -> int:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict
    state = checkpoint_entries(model, opt, handle, reset_compressor_state=reset_compressor_state) \
        if handle is not None else checkpoint_entries(model, opt, None)
    state["train"] = {"step": 0}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return int(state["train"]["step"])


def held_out(model, rank) -> float:
    with torch.no_grad():
        x, y = batch(10**6, rank)
        loss = nn.functional.cross_entropy(model(x).float().reshape(-1, VOCAB), y.reshape(-1)).detach()
    dist.all_reduce(loss)
    return float(loss) / dist.get_world_size()


def train(args) -> dict:
    """Run the loop; returns the final held-out loss, a digest of the parameters and the bytes."""
    rank = dist.get_rank()
    model, handle, opt = build(args)
    start = load(args.ckpt, model, opt, handle, args.reset_compressor_state) if args.resume else 0
    for step in range(start, args.steps):
        x, y = batch(step, rank)
        loss = nn.functional.cross_entropy(model(x).float().reshape(-1, VOCAB), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        if rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
            print(f"step {step:4d} loss {loss.item():.4f}", flush=True)
        if args.ckpt and args.save_at == step + 1:
            save(args.ckpt, step + 1, model, opt, handle)
    final = held_out(model, rank)
    model.reshard()
    digest = hashlib.sha256(b"".join(p.detach().full_tensor().float().numpy().tobytes()
                                     for p in model.parameters())).hexdigest()
    stats = handle.comm_stats() if handle is not None else None
    if rank == 0:
        print(f"held-out loss {final:.4f}  params {digest[:16]}", flush=True)
        if stats is not None and "intra_node_bytes" in stats:
            print(f"bytes this rank: intra-node {stats['intra_node_bytes']} (fp32 {stats['intra_node_dense_bytes']}), "
                  f"inter-node {stats['inter_node_bytes']} (fp32 {stats['inter_node_dense_bytes']}, "
                  f"{stats['inter_node_ratio']:.1f}x fewer)", flush=True)
    return {"loss": final, "digest": digest, "stats": stats, "steps": args.steps - start}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mesh", default="2x2", help="replicate x shard, e.g. 2x2 (product = ranks)")
    p.add_argument("--replicate", default="4", help="'exact' (native HSDP) or the bit width of the inter-node all-reduce")
    p.add_argument("--no-ef", action="store_true", help="no error feedback on the inter-node all-reduce")
    p.add_argument("--weights", default="none", choices=("none", "blockwise", "difference"),
                   help="the parameter all-gather: FSDP's own, 8-bit blockwise (qwZ) or 4-bit differences (qWD)")
    p.add_argument("--grad-bits", type=int, default=32,
                   help="plain FSDP2 (mesh 1xN) only: bit width of the gradient reduce-scatter (32 = exact)")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True,
                   help="bf16 parameters in compute (MixedPrecisionPolicy), float32 reduction")
    p.add_argument("--ckpt", default="", help="DCP checkpoint directory")
    p.add_argument("--save-at", type=int, default=0, help="save the checkpoint after this many steps")
    p.add_argument("--resume", action="store_true", help="load --ckpt first and continue from its step")
    p.add_argument("--reset-compressor-state", action="store_true",
                   help="resume on another mesh: load model and optimizer, restart bitscom's state")
    p.add_argument("--log-every", type=int, default=10)
    return p


def main(argv=None) -> dict:
    args = parser().parse_args(argv)
    if args.replicate != "exact" and not args.replicate.isdigit():
        raise SystemExit(f"--replicate must be 'exact' or a bit width, got {args.replicate!r}")
    if (args.resume or args.save_at) and not args.ckpt:
        raise SystemExit("--resume and --save-at need --ckpt DIR")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    bitscom.init()
    return train(args)


if __name__ == "__main__":
    main(sys.argv[1:])
    bitscom.shutdown()
