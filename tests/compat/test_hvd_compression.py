"""Horovod-style compression: ``Compression.fp16.compress(t) -> (t, ctx)``, user codecs, and
their use in ``bitscom.allreduce(compression=...)`` and the compressor registry."""
import pytest
import torch

import bitscom as hvd
from bitscom.compression import Compression, Compressor, HorovodAdapter
from bitscom.compressors import get


class HalfCodec(Compressor):
    @staticmethod
    def compress(tensor):
        return tensor.to(torch.float16), tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        return tensor.to(ctx)


class ScaledCodec:
    """Not a subclass: duck-typed, and an instance rather than a class."""

    def __init__(self, factor):
        self.factor = factor

    def compress(self, tensor):
        return tensor * self.factor, None

    def decompress(self, tensor, ctx):
        return tensor / self.factor


class IntCodec(Compressor):
    @staticmethod
    def compress(tensor):
        return tensor.round().to(torch.int32), tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        return tensor.to(ctx)


def test_casting_compressors_speak_horovods_codec_interface():
    t = torch.tensor([1.0, 1 / 3, -70000.0], dtype=torch.float32)
    wire, ctx = Compression.fp16.compress(t)
    assert wire.dtype == torch.float16 and ctx == torch.float32
    back = Compression.fp16.decompress(wire, ctx)
    assert back.dtype == torch.float32
    assert back[0] == 1.0 and abs(back[1] - 1 / 3) < 1e-3 and back[2] == float("-inf")
    wire, ctx = Compression.bf16.compress(t.double())
    assert wire.dtype == torch.bfloat16 and Compression.bf16.decompress(wire, ctx).dtype == torch.float64
    ints = torch.tensor([1, 2])
    wire, ctx = Compression.fp16.compress(ints)            # integers are not cast
    assert wire is ints and Compression.fp16.decompress(wire, ctx) is ints
    wire, ctx = Compression.none.compress(t)
    assert wire is t and Compression.none.decompress(wire, ctx) is t


def test_registry_wraps_codecs_and_fingerprints_are_rank_independent():
    a = get(HalfCodec)
    assert isinstance(a, HorovodAdapter) and a.fingerprint().endswith("HalfCodec)")
    b, c = get(ScaledCodec(2.0)), get(ScaledCodec(2.0))
    assert b.fingerprint() == c.fingerprint()               # no object address in it
    assert get(Compression.fp16) is Compression.fp16        # bitscom compressors pass through
    with pytest.raises(ValueError, match="settings"):
        get(HalfCodec, rank=2)
    with pytest.raises(TypeError, match="compress"):
        HorovodAdapter(object())
    with pytest.raises(ValueError, match="unknown compressor"):
        get(type(Compression.fp16))                         # a bitscom class, not an instance


def _compressed_allreduce(rank, world):
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(1000, generator=g) * 10
    x64 = x.double()
    return (x64, hvd.allreduce(x, compression=Compression.fp16),
            hvd.allreduce(x, compression=HalfCodec, op=hvd.Sum),
            hvd.allreduce(x, compression=ScaledCodec(4.0)),
            hvd.allreduce(x, compression=Compression.bf16, name="bf16"))


def test_allreduce_with_compression_matches_float64_within_wire_precision(pools):
    results = pools.run(2, _compressed_allreduce)
    xs = [r[0] for r in results]
    avg, total = (xs[0] + xs[1]) / 2, xs[0] + xs[1]
    for _, fp16, codec_sum, scaled, bf16 in results:
        assert fp16.dtype == codec_sum.dtype == scaled.dtype == bf16.dtype == torch.float32
        # fp16 has an 11-bit significand: each of the 2 roundings costs <= 2^-11 relative
        bound = 3 * 2.0 ** -11 * (xs[0].abs() + xs[1].abs())
        assert ((fp16.double() - avg).abs() <= bound / 2 + 1e-6).all()
        assert ((codec_sum.double() - total).abs() <= bound + 1e-6).all()
        assert not torch.equal(fp16.double(), avg)           # it really went through fp16
        torch.testing.assert_close(scaled.double(), avg, rtol=1e-5, atol=1e-5)
        bound16 = 3 * 2.0 ** -8 * (xs[0].abs() + xs[1].abs())
        assert ((bf16.double() - avg).abs() <= bound16 / 2 + 1e-6).all()
    for i in range(1, 5):
        assert torch.equal(results[0][i], results[1][i])


def _int_codec(rank, world):
    try:
        state, hook = hvd.ddp_comm_hook(IntCodec)
        flat = torch.ones(4)
        from bitscom.compressors.base import BucketLayout, Comm, drive
        comp = state.compressor
        drive(comp.reduce(flat, BucketLayout.for_tensor(flat), comp.init_state(None), Comm()))
    except TypeError as err:
        return str(err)
    return None


def test_codec_with_integer_wire_fails_clearly_on_every_rank(pools):
    for msg in pools.run(2, _int_codec):
        assert msg is not None and "IntCodec.compress returned torch.int32" in msg


def test_allreduce_rejects_a_non_codec_compression():
    with pytest.raises(TypeError, match="LowBitGroup"):
        hvd.allreduce(torch.ones(2), compression=hvd.compressors.get("topk", ratio=0.5))
