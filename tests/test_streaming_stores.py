"""The final decodes write with non-temporal (streaming) stores when the output is 32-byte
aligned, and with ordinary stores otherwise: both must give the torch reference's bits, so
the same data decoded into an aligned and a misaligned buffer is compared with torch_ref."""

import pytest
import torch

from bitscom import kernels as K
from bitscom.kernels import cpu_native, torch_ref

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="no C++ compiler: native kernels absent")


def _views(n, shift):
    """A float32 view of n elements whose address is ``shift`` floats past a 64-byte boundary."""
    base = torch.full((n + 16,), float("nan"))
    assert base.data_ptr() % 32 == 0
    return base, base[shift:shift + n]


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("shift", [0, 1, 8])        # aligned (streams), misaligned, aligned again
def test_decode_into_aligned_and_misaligned_outputs_matches_torch(bits, shift):
    x = torch.randn(128 * 37, generator=torch.Generator().manual_seed(bits))
    payload, scales = K.quantize_pack(x, bits, 128, impl="torch")
    ref = torch_ref.unpack_dequantize_accumulate(payload.reshape(1, -1), scales.reshape(1, -1), x.numel(), bits,
                                                 128, torch.empty(x.numel()), False)
    base, out = _views(x.numel(), shift)
    K.unpack_dequantize(payload, scales, x.numel(), bits, 128, out=out, impl="native")
    assert torch.equal(out, ref)
    assert base[:shift].isnan().all() and base[shift + x.numel():].isnan().all()   # nothing written outside


@pytest.mark.parametrize("m,shift", [(64, 0), (64, 1), (60, 0), (13, 0)])
def test_lowrank_product_streams_the_same_bits(m, shift):
    g = torch.Generator().manual_seed(m)
    n, r = 33, 4
    p, q = torch.randn(n, r, generator=g), torch.randn(m, r, generator=g)
    ref = torch.zeros(n, m)
    for j in range(r):                                # left to right, each multiply and add rounded
        term = p[:, j:j + 1] * q[:, j].reshape(1, -1)
        ref = term if j == 0 else ref + term
    base, out = _views(n * m, shift)
    cpu_native.lowrank_product(out.data_ptr(), n, m, p, q)
    assert torch.equal(out.view(n, m), ref)
    assert base[:shift].isnan().all() and base[shift + n * m:].isnan().all()
