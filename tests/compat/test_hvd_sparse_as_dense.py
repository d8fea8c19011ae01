"""``DistributedOptimizer(sparse_as_dense=True)`` through the import swap (``import bitscom as hvd``).

Horovod densifies a sparse gradient for the all-reduce and hands ``aggregated.to_sparse()`` back
to the optimizer (horovod/torch/optimizer.py), so ``SparseAdam`` steps. These tests hold bitscom
to that against float64 references: the gradient the wrapped optimizer sees (a step pre-hook
records it) is sparse, coalesced, element-wise (``sparse_dim == p.dim()``, Horovod's
``to_sparse()``) and equals the average of every rank's own gradient; dense parameters keep
dense gradients; the ranks agree bitwise, also under compression, when one rank's batch skipped
the embedding, over accumulated passes, and when a rank joined early (``hvd.join()``).
Horovod's own ``test_sparse_embeddings`` (both values of ``sparse_as_dense``) is ported in
test_hvd_sparse.py.
"""
import pytest
import torch
import torch.nn as nn

import bitscom as hvd

ROWS, DIM = 12, 4


class _Model(nn.Module):
    """A sparse embedding and a dense head: the head's gradient must stay dense."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.emb = nn.Embedding(ROWS, DIM, sparse=True).double()
        self.head = nn.Linear(DIM, 1).double()

    def forward(self, idx, use_emb):
        x = self.emb(idx) if use_emb else torch.ones(len(idx), DIM, dtype=torch.float64)
        return self.head(x).square().mean()


def _indices(rank, step, k):
    g = torch.Generator().manual_seed(100 * step + 10 * k + rank)
    return torch.randint(0, ROWS, (4 + 3 * rank,), generator=g)     # duplicates, uneven nnz


# per step: per rank, whether each backward pass of the step uses the embedding
PLAN_ONE_PASS = [[[True], [True]],          # both sparse
                 [[True], [False]],         # rank 1 has no gradient: sparse on both all the same
                 [[False], [False]]]        # sparse nowhere: a dense (zero) gradient, as Horovod
PLAN_TWO_PASSES = [[[True, False], [True, True]],    # rank 0's sparse gradient came in pass 1 only
                   [[False, True], [True, False]]]


def _train(rank, world, plan, passes):
    model = _Model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   backward_passes_per_step=passes, sparse_as_dense=True)
    seen = []

    def record(optimizer, args, kwargs):       # what the wrapped optimizer's step gets
        e, h = model.emb.weight.grad, model.head.weight.grad
        seen.append({"sparse": e.is_sparse, "coalesced": e.is_sparse and e.is_coalesced(),
                     "sparse_dim": e.sparse_dim() if e.is_sparse else None,
                     "indices": e.indices().clone() if e.is_sparse else None,
                     "emb": e.to_dense().clone(), "head_sparse": h.is_sparse, "head": h.clone()})
    opt.register_step_pre_hook(record)
    for step, per_rank in enumerate(plan):
        opt.zero_grad()
        for k, use_emb in enumerate(per_rank[rank]):
            model(_indices(rank, step, k), use_emb).backward()
        opt.step()
    sent = opt.comm_stats()["bytes_sent"]
    opt.close()
    return seen, sent


def _reference(plan):
    """float64, one process: each step's averaged (emb, head) gradient along SGD's trajectory,
    and whether any rank's embedding gradient was sparse."""
    model = _Model()
    params = list(model.parameters())
    out = []
    for step, per_rank in enumerate(plan):
        grads = []
        for rank, passes in enumerate(per_rank):
            model.zero_grad()
            for k, use_emb in enumerate(passes):
                model(_indices(rank, step, k), use_emb).backward()
            grads.append([torch.zeros_like(p) if p.grad is None else p.grad.to_dense() for p in params])
        avg = [(a + b) / 2 for a, b in zip(*grads)]
        out.append(((avg[0], avg[1]), any(any(passes) for passes in per_rank)))
        with torch.no_grad():
            for p, g in zip(params, avg):
                p -= 0.1 * g
    return out


@pytest.mark.parametrize("plan,passes", [(PLAN_ONE_PASS, 1), (PLAN_TWO_PASSES, 2)],
                         ids=["one_pass", "two_passes"])
def test_optimizer_sees_the_sparse_average_float64_reference(pools, plan, passes):
    got = pools.run(2, _train, plan, passes, timeout=90)
    ref = _reference(plan)
    for step, ((emb_ref, head_ref), any_sparse) in enumerate(ref):
        for rank in range(2):
            s = got[rank][0][step]
            assert s["sparse"] == any_sparse, (step, rank, s["sparse"])
            assert not s["head_sparse"], "a dense parameter's gradient must stay dense"
            torch.testing.assert_close(s["emb"], emb_ref, rtol=1e-12, atol=1e-15)
            torch.testing.assert_close(s["head"], head_ref, rtol=1e-12, atol=1e-15)
            if any_sparse:      # Horovod's aggregated.to_sparse(): the nonzero entries, coalesced
                assert s["coalesced"] and s["sparse_dim"] == 2
                assert torch.equal(s["indices"], emb_ref.to_sparse().indices()), (step, rank)
        a, b = got[0][0][step], got[1][0][step]
        assert torch.equal(a["emb"], b["emb"]) and torch.equal(a["head"], b["head"]), "ranks differ"
        if any_sparse:
            assert torch.equal(a["indices"], b["indices"])
    # the layout round is one byte per trainable parameter (3) per step, counted with the buckets
    assert got[0][1] == got[1][1] > 0


def _sparse_adam(rank, world, compression, steps):
    torch.manual_seed(5)
    emb = nn.Embedding(ROWS, DIM, sparse=True)
    target = torch.linspace(-1, 1, DIM)
    opt = hvd.DistributedOptimizer(torch.optim.SparseAdam(list(emb.parameters()), lr=0.05),
                                   compression=compression, sparse_as_dense=True)
    weights = []
    for step in range(steps):
        opt.zero_grad()
        (emb(_indices(rank, step, 0)) - target).square().sum().backward()
        assert emb.weight.grad.is_sparse
        opt.step()
        weights.append(emb.weight.detach().clone())
    opt.close()
    return weights


def _sparse_adam_reference(steps):
    torch.manual_seed(5)
    emb = nn.Embedding(ROWS, DIM, sparse=True).double()
    target = torch.linspace(-1, 1, DIM, dtype=torch.float64)
    adam = torch.optim.SparseAdam(list(emb.parameters()), lr=0.05)
    weights = []
    for step in range(steps):
        grads = [torch.autograd.grad((emb(_indices(r, step, 0)) - target).square().sum(),
                                     emb.weight)[0].to_dense() for r in range(2)]
        emb.weight.grad = ((grads[0] + grads[1]) / 2).to_sparse()
        adam.step()
        weights.append(emb.weight.detach().clone())
    return weights


@pytest.mark.parametrize("compression", [hvd.Compression.none, hvd.Compression.fp16, "lowbit"],
                         ids=["none", "fp16", "lowbit"])
def test_sparse_adam_steps_keep_replicas_identical(pools, compression):
    steps = 4
    w0, w1 = pools.run(2, _sparse_adam, compression, steps, timeout=90)
    for step, (a, b) in enumerate(zip(w0, w1)):
        assert torch.equal(a, b), f"replicas differ after SparseAdam step {step}"
    if compression is hvd.Compression.none:
        for a, r in zip(w0, _sparse_adam_reference(steps)):
            torch.testing.assert_close(a.double(), r, rtol=1e-5, atol=1e-6)


def _join(rank, world):
    torch.manual_seed(5)
    emb = nn.Embedding(ROWS, DIM, sparse=True).double()
    opt = hvd.DistributedOptimizer(torch.optim.SparseAdam(list(emb.parameters()), lr=0.05),
                                   sparse_as_dense=True)
    last_grad = None
    for step in range(3 if rank == 0 else 2):             # uneven inputs: rank 1 joins early
        opt.zero_grad()
        emb(_indices(rank, step, 0)).square().sum().backward()
        last_grad = emb.weight.grad.to_dense().clone()
        opt.step()
    last = hvd.join()
    hvd.broadcast_parameters(emb.state_dict(), root_rank=0)
    return last, last_grad, emb.weight.detach().clone()


def test_join_shadow_step_takes_part_in_the_layout_round(pools):
    (j0, g0, w0), (j1, _, w1) = pools.run(2, _join, timeout=90)
    assert j0 == j1 and torch.equal(w0, w1)
    # rank 0's third step: the joined rank sent zeros, so the average is rank 0's gradient / 2
    torch.manual_seed(5)
    ref = nn.Embedding(ROWS, DIM, sparse=True).double()
    adam = torch.optim.SparseAdam(list(ref.parameters()), lr=0.05)
    for step in range(2):
        grads = [torch.autograd.grad(ref(_indices(r, step, 0)).square().sum(), ref.weight)[0].to_dense()
                 for r in range(2)]
        ref.weight.grad = ((grads[0] + grads[1]) / 2).to_sparse()
        adam.step()
    own = torch.autograd.grad(ref(_indices(0, 2, 0)).square().sum(), ref.weight)[0].to_dense()
    torch.testing.assert_close(g0, own / 2, rtol=1e-12, atol=1e-15)
