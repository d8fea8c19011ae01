"""The Accelerate recipes of docs/integrations.md, on 2 gloo CPU ranks started as torchrun does."""

import pytest

from launch import records, run_ranks
from references import FP32_BYTES, NUMEL, lowbit_bytes

pytest.importorskip("accelerate")


def _check_training(found) -> None:
    (_, before, after, sent, dense, digest0), (_, before1, after1, sent1, _, digest1) = found
    assert digest0 == digest1, "replicas differ after training"
    assert (before, after) == (before1, after1)
    assert after < before, f"training did not lower the loss: {before} -> {after}"
    assert dense == FP32_BYTES and sent == sent1 == lowbit_bytes(NUMEL, 2, bits=4)
    assert dense / sent > 4.7                    # 4-bit + scales: 4.79x fewer bytes than fp32


def test_accelerate_prepare_then_ddp_comm_hook():
    out = run_ranks("accelerate_ddp_hook.py")
    _check_training(records("".join(out)))


def test_accelerate_data_only_with_distributed_optimizer_and_refusal_of_ddp_model():
    out = run_ranks("accelerate_optimizer.py")
    _check_training(records("".join(out)))
    for rank, text in enumerate(out):
        assert f"REFUSED rank={rank} the model's parameters belong to a DistributedDataParallel" in text, text[-3000:]
