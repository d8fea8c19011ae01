"""The lowbit package: old import paths re-export the same objects, one Hadamard with two back
ends, the "residual" error-feedback vocabulary (the seed's "legacy" accepted as an alias)."""

import math

import pytest
import torch

import bitscom.collectives as collectives
import bitscom.error_feedback as error_feedback
import bitscom.lowbit as lowbit
import bitscom.quantization as quantization
from bitscom.compressors import LowBit
from bitscom.lowbit import LowBitConfig, canonical_fingerprint, hadamard
from bitscom.sharded.rotation import rotate


def test_old_import_paths_are_the_package_objects():
    for module in (collectives, quantization, error_feedback):
        for name in module.__all__:
            assert getattr(module, name) is getattr(lowbit, name), f"{module.__name__}.{name}"


def _sylvester(n):
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


@pytest.mark.parametrize("backend", ["butterfly", "gemm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_both_hadamard_backends_are_the_transform(backend, dtype):
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    y = hadamard(x, 32, backend=backend)
    assert y.dtype == dtype and y.shape == x.shape
    ref = (x.double().view(-1, 32) @ _sylvester(32)).view(6, 64)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert torch.allclose(y.double(), ref, atol=tol, rtol=tol)
    assert torch.allclose(hadamard(y, 32, backend=backend).double(), x.double(), atol=tol * 4, rtol=tol)


def test_sharded_rotation_is_the_gemm_backend_and_the_format_uses_the_butterfly():
    x = torch.randn(32 * 40, generator=torch.Generator().manual_seed(2))
    assert torch.equal(rotate(x), hadamard(x, backend="gemm"))
    assert torch.equal(quantization.hadamard(x), hadamard(x, backend="butterfly"))
    with pytest.raises(ValueError, match=r"backend must be one of \('butterfly', 'gemm'\), got 'fft'"):
        hadamard(x, backend="fft")


def test_residual_is_the_name_and_legacy_its_alias():
    residual = LowBitConfig(bitwidth=2, error_feedback_mode="residual")
    legacy = LowBitConfig(bitwidth=2, error_feedback_mode="legacy")
    assert residual == legacy == LowBitConfig(bitwidth=2, error_feedback=True)
    assert legacy.error_feedback_mode == "residual" and legacy.residual and legacy.legacy
    assert repr(residual) == repr(legacy)
    assert LowBit(config=legacy).fingerprint() == LowBit(config=residual).fingerprint()
    assert LowBitConfig.build(legacy, error_feedback_mode="legacy") == residual
    assert "residual" in lowbit.EF_MODES and lowbit.EF_MODE_ALIASES == {"legacy": "residual"}
    with pytest.raises(ValueError, match="'legacy': 'residual'"):
        LowBitConfig(error_feedback_mode="resid")


def test_an_old_fingerprint_reads_as_the_new_one():
    old = repr(LowBitConfig(error_feedback=True)).replace("'residual'", "'legacy'")
    assert canonical_fingerprint(f"LowBit({old})") == LowBit(config=LowBitConfig(error_feedback=True)).fingerprint()
