"""Horovod's sparse path through the import swap (``import bitscom as hvd``).

Ports of horovod/test/parallel/test_torch.py's ``test_async_sparse_allreduce`` (all-gathered
indices and values equal the dense all-reduce) and ``test_sparse_embeddings`` (a sparse
embedding trains with ``SparseAdam`` under ``DistributedOptimizer``, with either value of
``sparse_as_dense``, as Horovod's loop runs it; sparse_as_dense=True in depth:
test_hvd_sparse_as_dense.py),
plus float64 references: the reduced sparse gradient is the average of every rank's dense
gradient, coalesced and bitwise the same on every rank; mismatched calls fail on every rank.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import bitscom as hvd

SIZES = [17, 32, 81, 12, 15, 23, 22] * 2


def _random_sparse(g, *shape, dtype=torch.float32):
    t = torch.rand(*shape, generator=g, dtype=torch.float64)
    t[t < 0.8] = 0
    return t.to(dtype).to_sparse()


def _tensors(rank):
    g = torch.Generator().manual_seed(100 + rank)
    return [_random_sparse(g, d0, 10) for d0 in SIZES]


def _async_sparse(rank, world):
    tensors = _tensors(rank)
    dense = [hvd.allreduce(t.to_dense()) for t in tensors]
    handles = [hvd.sparse_allreduce_async(t, op=hvd.Average, name=str(i))
               for i, t in enumerate(tensors)]
    gathered = [handle() for handle in handles]          # Horovod calls its handles
    g = torch.Generator().manual_seed(7 + rank)
    f64 = _random_sparse(g, 9, 4, dtype=torch.float64)
    hybrid = _random_sparse(g, 6, 5).to_dense().to_sparse(1)          # sparse_dim=1, dense rows
    ints = (torch.arange(12).view(4, 3) * (rank + 1) * (torch.arange(12).view(4, 3) % 3 == rank))
    extra = {"f64": hvd.synchronize(hvd.sparse_allreduce_async(f64, name="f64")),
             "hybrid_sum": hvd.sparse_allreduce(hybrid, op=hvd.Sum),
             "int_sum": hvd.sparse_allreduce(ints.to_sparse(), op=hvd.Sum),
             "inputs": (f64, hybrid)}
    return dense, gathered, extra


def test_async_sparse_allreduce(pools):
    """Horovod's test: allgather over indices and values is equivalent to allreduce."""
    got = pools.run(2, _async_sparse, timeout=60)
    refs = [torch.stack([t.to_dense().double() for t in ts]).mean(0)
            for ts in zip(_tensors(0), _tensors(1))]
    for dense, gathered, extra in got:
        for reduced, sparse, ref in zip(dense, gathered, refs):
            assert sparse.is_sparse and sparse.is_coalesced()
            assert torch.allclose(reduced, sparse.to_dense(), 1e-6)
            torch.testing.assert_close(sparse.to_dense().double(), ref, rtol=1e-6, atol=1e-7)
        f64s = [e["inputs"][0] for _, _, e in got]
        hybrids = [e["inputs"][1] for _, _, e in got]
        assert extra["f64"].dtype == torch.float64
        torch.testing.assert_close(extra["f64"].to_dense(), (f64s[0].to_dense() + f64s[1].to_dense()) / 2,
                                   rtol=1e-15, atol=0)
        assert extra["hybrid_sum"].sparse_dim() == 1
        torch.testing.assert_close(extra["hybrid_sum"].to_dense(),
                                   hybrids[0].to_dense() + hybrids[1].to_dense())
        ints = [torch.arange(12).view(4, 3) * (r + 1) * (torch.arange(12).view(4, 3) % 3 == r)
                for r in range(2)]
        assert torch.equal(extra["int_sum"].to_dense(), ints[0] + ints[1])
    for a, b in zip(got[0][1] + [got[0][2]["f64"]], got[1][1] + [got[1][2]["f64"]]):
        assert torch.equal(a.indices(), b.indices()) and torch.equal(a.values(), b.values())


def _face_mismatch(rank, world):
    errors = []
    t = torch.eye(4)
    try:        # a sparse call on rank 0, a dense one on rank 1: the header says so
        hvd.sparse_allreduce(t.to_sparse()) if rank == 0 else hvd.allreduce(t)
    except RuntimeError as err:
        errors.append(str(err))
    try:        # the same dense shape, different sparse_dim
        hvd.sparse_allreduce(t.to_sparse(2 if rank == 0 else 1))
    except RuntimeError as err:
        errors.append(str(err))
    after = hvd.sparse_allreduce(t.to_sparse(), op=hvd.Sum)     # the ranks line up again
    return errors, after.to_dense()


def test_sparse_allreduce_mismatch_fails_on_every_rank(pools):
    got = pools.run(2, _face_mismatch, timeout=60)
    for errors, after in got:
        assert len(errors) == 2, errors
        assert "disagree on the operation" in errors[0]
        assert "disagree on sparse_dim" in errors[1]
        assert torch.equal(after, 2 * torch.eye(4))


def test_sparse_allreduce_single_process_and_argument_errors():
    t = torch.tensor([[0.0, 2.0], [0.0, 0.0], [1.0, 0.0]]).to_sparse()
    dup = torch.sparse_coo_tensor([[0, 0, 2]], torch.tensor([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]), (3, 2))
    h = hvd.sparse_allreduce_async(dup, name="dup")
    assert isinstance(h, hvd.Handle)
    out = hvd.synchronize(h)
    assert out.is_coalesced() and torch.equal(out.to_dense(), dup.to_dense())
    assert torch.equal(hvd.sparse_allreduce(t, op=hvd.Sum).to_dense(), t.to_dense())
    with pytest.raises(TypeError, match="sparse COO"):
        hvd.sparse_allreduce(torch.ones(2))
    with pytest.raises(ValueError, match=r"sparse_allreduce op must be one of \(<ReduceOp.AVERAGE: 'average'>, "
                                         r"<ReduceOp.SUM: 'sum'>\), got <ReduceOp.MAX: 'max'>"):
        hvd.sparse_allreduce(t, op=hvd.Max)
    with pytest.raises(NotImplementedError, match="Adasum"):
        hvd.sparse_allreduce(t, op=hvd.Adasum)


# -- DistributedOptimizer ------------------------------------------------------------------
class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.Embedding(10, 3, sparse=True)

    def forward(self, x):
        return self.embedding(x)


_INPUTS = {0: torch.LongTensor([[1, 2, 4, 5], [4, 3, 2, 9]]),
           1: torch.LongTensor([[1, 3, 4], [4, 7, 9]])}


def _sparse_embeddings(rank, world, steps):
    """Horovod's test_sparse_embeddings (both values of sparse_as_dense, in one process, as
    Horovod loops), for a few steps."""
    out = {}
    for sparse_as_dense in [False, True]:
        model = _Net()
        opt = torch.optim.SparseAdam(list(model.parameters()), lr=0.1)
        opt = hvd.DistributedOptimizer(opt, sparse_as_dense=sparse_as_dense)
        grads = []
        for _ in range(steps):
            loss = model(_INPUTS[rank]).sum()
            opt.zero_grad()
            loss.backward()
            grad = model.embedding.weight.grad
            grads.append((grad.is_sparse, grad.is_coalesced(), grad.sparse_dim(), grad.indices(),
                          grad.values()))
            opt.step()
        opt.close()
        out[sparse_as_dense] = model.embedding.weight.detach().clone(), grads
    return out


def test_sparse_embeddings(pools):
    """sparse_as_dense=False: reduced sparse, rows whole (sparse_dim 1); True: reduced dense and
    handed back as Horovod's aggregated.to_sparse() (element-wise, sparse_dim 2). Both train
    SparseAdam to the float64 reference and keep the replicas bitwise equal."""
    steps = 3
    got = pools.run(2, _sparse_embeddings, steps, timeout=60)
    ref = _Net().double()
    avg = sum(torch.autograd.grad(ref(_INPUTS[r]).sum(), ref.embedding.weight)[0].to_dense()
              for r in range(2)) / 2
    adam = torch.optim.SparseAdam([ref.embedding.weight], lr=0.1)
    for _ in range(steps):            # the loss is linear: the same average gradient each step
        ref.embedding.weight.grad = avg.to_sparse()
        adam.step()
    for sparse_as_dense in (False, True):
        (w0, g0), (w1, g1) = got[0][sparse_as_dense], got[1][sparse_as_dense]
        assert torch.equal(w0, w1), f"replicas differ after SparseAdam steps ({sparse_as_dense=})"
        for a, b in zip(g0, g1):
            assert a[0] and a[1], "p.grad must be a coalesced sparse tensor"
            assert a[2] == (2 if sparse_as_dense else 1), (sparse_as_dense, a[2])
            assert torch.equal(a[3], b[3]) and torch.equal(a[4], b[4])
        grad = torch.sparse_coo_tensor(g0[0][3], g0[0][4], (10, 3)).to_dense().double()
        assert torch.equal(grad, avg), sparse_as_dense
        torch.testing.assert_close(w0.double(), ref.embedding.weight.detach(), rtol=1e-6, atol=1e-6)


class _Bag(nn.Module):
    def __init__(self, dtype):
        super().__init__()
        torch.manual_seed(1)
        self.emb = nn.Embedding(12, 4, sparse=True).to(dtype)
        self.head = nn.Linear(4, 1).to(dtype)

    def forward(self, idx, use_emb=True, tie=False):
        x = self.emb(idx) if use_emb else torch.ones(len(idx), 4, dtype=self.head.weight.dtype)
        loss = self.head(x).square().mean()
        return loss + self.emb.weight.square().sum() * 0.1 if tie else loss


def _batch(rank, step):
    g = torch.Generator().manual_seed(10 * step + rank)
    return torch.randint(0, 12, (5 + 2 * rank,), generator=g)     # duplicates, uneven nnz


def _train_bag(rank, world, op, plan, passes=1):
    """``plan``: per step, per rank (use_emb, tie); ``passes`` backward passes per step."""
    model = _Bag(torch.float64)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), op=op,
                                   backward_passes_per_step=passes)
    out = []
    for step, per_rank in enumerate(plan):
        use_emb, tie = per_rank[rank]
        opt.zero_grad()
        try:
            for _ in range(passes):
                model(_batch(rank, step), use_emb, tie).backward()
        except RuntimeError as err:
            out.append(str(err))
            continue
        g = model.emb.weight.grad
        out.append((g.is_sparse, g.is_sparse and g.is_coalesced(), g.to_dense().clone(),
                    model.head.weight.grad.clone(), opt.comm_stats()["bytes_sent"]))
        opt.step()
    opt.close()
    return out


def _reference_grads(plan_step, step, scale):
    """Every rank's float64 gradient at the initial parameters, summed and scaled."""
    grads = []
    for r, (use_emb, tie) in enumerate(plan_step):
        ref = _Bag(torch.float64)
        ref(_batch(r, step), use_emb, tie).backward()
        g = ref.emb.weight.grad
        grads.append(((torch.zeros(12, 4, dtype=torch.float64) if g is None else g.to_dense()),
                      ref.head.weight.grad))
    return [sum(g[i] for g in grads) * scale for i in range(2)]


def _check_first_step(got, emb_ref, head_ref):
    for r in range(2):
        sparse, coalesced, emb, head, sent = got[r][0]
        assert sparse and coalesced, "p.grad must be a coalesced sparse tensor"
        torch.testing.assert_close(emb, emb_ref, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(head, head_ref, rtol=1e-12, atol=1e-14)
        assert sent > 0


@pytest.mark.parametrize("op,scale", [(hvd.Average, 0.5), (hvd.Sum, 1.0)], ids=["average", "sum"])
def test_sparse_gradient_float64_reference(pools, op, scale):
    """The averaged (summed) sparse gradient equals the dense reduction of every rank's own;
    the ranks agree bitwise at every step (the second step after an SGD update)."""
    plan = [[(True, False), (True, False)]] * 2
    got = pools.run(2, _train_bag, op, plan, timeout=60)
    _check_first_step(got, *_reference_grads(plan[0], 0, scale))
    for a, b in zip(got[0], got[1]):
        assert a[0] and b[0]
        assert torch.equal(a[2], b[2]) and torch.equal(a[3], b[3]), "ranks differ"


def test_sparse_gradient_accumulates_over_passes(pools):
    plan = [[(True, False), (True, False)]]
    got = pools.run(2, _train_bag, hvd.Average, plan, 2, timeout=60)
    emb_ref, head_ref = _reference_grads(plan[0], 0, 0.5)
    _check_first_step(got, 2 * emb_ref, 2 * head_ref)


def test_sparse_gradient_unused_on_one_rank_matches_reference(pools):
    """A rank whose batch did not use the embedding (``p.grad`` None) contributes nothing."""
    plan = [[(True, False), (False, False)]]
    got = pools.run(2, _train_bag, hvd.Average, plan, timeout=60)
    _check_first_step(got, *_reference_grads(plan[0], 0, 0.5))


def test_sparse_on_one_rank_dense_on_another_fails_on_every_rank(pools):
    # step 0: rank 1's gradient is dense (the weight is also used densely), rank 0's sparse;
    # step 1: dense on both ranks (weight tying) — the dense path, as for any dense gradient.
    plan = [[(True, False), (True, True)], [(True, True), (True, True)]]
    got = pools.run(2, _train_bag, hvd.Average, plan, timeout=60)
    for r in range(2):
        err = got[r][0]
        assert isinstance(err, str) and "sparse on some ranks and dense on others" in err, err
        assert "sparse_as_dense=True" in err
        sparse, _, emb, _, _ = got[r][1]
        assert not sparse
    assert torch.equal(got[0][1][2], got[1][1][2])


def _functional(rank, world):
    w = nn.Parameter(torch.randn(6, 2))
    opt = hvd.DistributedOptimizer(torch.optim.SGD([w], lr=0.1))
    try:
        F.embedding(torch.tensor([rank, 3]), w, sparse=True).sum().backward()
    except TypeError as err:
        return str(err)
    finally:
        opt.close()
    return None


def test_sparse_gradient_of_unknown_origin_is_a_clear_error(pools):
    msgs = pools.run(2, _functional, timeout=60)
    assert all(m and "sparse_as_dense=True" in m and "nn.Embedding" in m for m in msgs), msgs
