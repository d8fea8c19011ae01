"""The DDP face (bitscom.ddp_comm_hook), tested the way PyTorch tests its own comm hooks: the
same model trained with a reference hook and with ours must produce the same gradients.

torch's ``fp16_compress_hook`` casts the bucket to fp16, divides by the world size, all-reduces
and casts back; bitscom's ``Compression.fp16`` and a Horovod-style fp16 codec do the same
operations in the same order, so the gradients must agree bit for bit, every step, on every
rank. Plain DDP (no hook) is the reference for ``Compression.none``, with ``no_sync``
accumulation and ``gradient_as_bucket_view``.
"""
import torch
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import bitscom
from bitscom.compression import Compressor


class HalfCodec(Compressor):
    """A user's own Horovod-style codec (fp16 on the wire)."""

    @staticmethod
    def compress(tensor):
        return tensor.to(torch.float16), tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        return tensor.to(ctx)


def _model(**ddp_kwargs):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
    return DDP(net, bucket_cap_mb=0.002, **ddp_kwargs)      # several small buckets


def _batches(rank, n, scale=1.0):
    g = torch.Generator().manual_seed(50 + rank)
    return [(scale * torch.randn(8, 12, generator=g), torch.randn(8, 4, generator=g)) for _ in range(n)]


def _grads_per_step(model, data, accumulate=1):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    out = []
    for i in range(0, len(data), accumulate):
        opt.zero_grad()
        chunk = data[i:i + accumulate]
        for j, (x, y) in enumerate(chunk):
            if j < len(chunk) - 1:
                with model.no_sync():
                    nn.functional.mse_loss(model(x), y).backward()
            else:
                nn.functional.mse_loss(model(x), y).backward()
        out.append(torch.cat([p.grad.reshape(-1).clone() for p in model.parameters()]))
        opt.step()
    return out


def _fp16_parity(rank, world):
    data = _batches(rank, 4, scale=3.0)
    ref = _model()
    ref.register_comm_hook(None, default_hooks.fp16_compress_hook)
    ours = _model()
    ours.register_comm_hook(*bitscom.ddp_comm_hook(bitscom.Compression.fp16))
    codec = _model()
    codec.register_comm_hook(*bitscom.ddp_comm_hook(HalfCodec))
    r, o, c = (_grads_per_step(m, data) for m in (ref, ours, codec))
    plain = _grads_per_step(_model(), data)
    return ([torch.equal(a, b) for a, b in zip(r, o)], [torch.equal(a, b) for a, b in zip(r, c)],
            o, max(float((a - b).abs().max()) for a, b in zip(o, plain)),
            max(float(b.abs().max()) for b in plain))


def test_fp16_hook_and_horovod_codec_match_torchs_fp16_hook_bitwise(pools):
    results = pools.run(2, _fp16_parity)
    for same_ours, same_codec, _grads, err, scale in results:
        assert all(same_ours) and len(same_ours) == 4
        assert all(same_codec)
        assert 0 < err <= 2e-3 * scale          # fp16 really was on the wire, and only that
    assert all(torch.equal(a, b) for a, b in zip(results[0][2], results[1][2]))   # ranks agree


def _reference_bf16_hook(state, bucket):
    """torch's bf16_compress_hook written out (torch registers its own only for NCCL)."""
    buf = bucket.buffer()
    wire = buf.to(torch.bfloat16).div_(torch.distributed.get_world_size())
    fut = torch.distributed.all_reduce(wire, async_op=True).get_future()

    def back(f):
        buf.copy_(f.value()[0])
        return buf
    return fut.then(back)


def _bf16_parity(rank, world):
    data = _batches(rank, 3)
    ref = _model()
    ref.register_comm_hook(None, _reference_bf16_hook)
    ours = _model()
    ours.register_comm_hook(*bitscom.ddp_comm_hook("bf16"))
    return all(torch.equal(a, b) for a, b in zip(_grads_per_step(ref, data), _grads_per_step(ours, data)))


def test_bf16_hook_matches_the_bf16_reference_hook_bitwise(pools):
    assert pools.run(2, _bf16_parity) == [True, True]


def _no_sync_and_bucket_view(rank, world):
    data = _batches(rank, 6)
    plain = _grads_per_step(_model(), data, accumulate=3)
    hooked = _model(gradient_as_bucket_view=True)
    hooked.register_comm_hook(*bitscom.ddp_comm_hook(bitscom.Compression.none))
    ours = _grads_per_step(hooked, data, accumulate=3)
    # float64 reference: the average over ranks of the per-rank accumulated gradients
    return plain, ours


def test_none_hook_with_no_sync_and_bucket_view_equals_plain_ddp(pools):
    results = pools.run(2, _no_sync_and_bucket_view)
    for plain, ours in results:
        assert len(plain) == 2 and all(torch.equal(a, b) for a, b in zip(plain, ours))
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1]))


def _local_reference(rank, world):
    """One step: DDP + our hook against a float64 average of both ranks' local gradients."""
    model = _model()
    model.register_comm_hook(*bitscom.ddp_comm_hook(bitscom.Compression.none))
    x, y = _batches(rank, 1)[0]
    nn.functional.mse_loss(model(x), y).backward()
    ddp_grad = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    local = _model().module.double()
    nn.functional.mse_loss(local(x.double()), y.double()).backward()
    return ddp_grad, torch.cat([p.grad.reshape(-1) for p in local.parameters()])


def test_hooked_gradient_is_the_average_of_local_gradients(pools):
    (g0, l0), (g1, l1) = pools.run(2, _local_reference)
    ref = (l0 + l1) / 2
    torch.testing.assert_close(g0.double(), ref, rtol=1e-5, atol=1e-6)
    assert torch.equal(g0, g1)
