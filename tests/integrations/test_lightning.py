"""The Lightning recipe of docs/integrations.md: ``python lightning_ddp_hook.py`` with
``devices=2`` (Lightning starts the second rank itself)."""

import pytest
import torch

from launch import records, run_self_launching
from references import FP32_BYTES, SHAPES, powersgd_bytes

pytest.importorskip("lightning")


def test_lightning_callback_registers_ddp_comm_hook():
    found = records(run_self_launching("lightning_ddp_hook.py"))
    (_, before, after, sent, dense, digest0), (_, _, _, sent1, _, digest1) = found
    assert digest0 == digest1, "replicas differ after training"
    assert after < before, f"training did not lower the loss: {before} -> {after}"
    assert dense == FP32_BYTES and sent == sent1 == powersgd_bytes(SHAPES, rank=2)
    assert dense / sent > 4.5                    # PowerSGD rank 2: 4.6x fewer bytes than fp32


def test_lightning_ignores_strategy_comm_hook_on_cpu():
    """Why the recipe uses a callback: Lightning 2.6's DDPStrategy registers ddp_comm_hook on
    CUDA only, silently (a CPU run would send fp32 and report nothing). If the CPU case starts
    failing, Lightning registers it on CPU too and docs/integrations.md should say so."""
    from lightning.pytorch.strategies import DDPStrategy
    from torch.nn.parallel import DistributedDataParallel

    class FakeDDP(DistributedDataParallel):       # records the registration, wraps nothing
        def __init__(self):
            self.calls = []

        def register_comm_hook(self, state, hook):
            self.calls.append(state)

    def registered(device: str) -> list:
        state = object()
        strategy = DDPStrategy(parallel_devices=[torch.device(device)], ddp_comm_state=state,
                               ddp_comm_hook=lambda state, bucket: None)
        model = FakeDDP()
        strategy.model = model
        strategy._register_ddp_hooks()
        return [s is state for s in model.calls]

    assert registered("cuda:0") == [True]         # the control: the strategy does register on CUDA
    assert registered("cpu") == []
