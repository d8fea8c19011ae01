"""What the low-bit parameter all-gather remembers and counts, per FSDP module."""

from __future__ import annotations

import dataclasses
import zlib
from typing import Optional

import torch

__all__ = ["WeightState", "GatherCount"]


@dataclasses.dataclass
class GatherCount:
    """Bytes of the compressed all-gathers and of FSDP's own all-gather of the same inputs."""

    bytes_sent: int = 0
    dense_bytes: int = 0
    calls: int = 0


class WeightState:
    """Per FSDP module: the gather count (keys the seeds) and, for ``"difference"``, the last replica."""

    def __init__(self) -> None:
        self.gathers = 0
        self.reference: Optional[torch.Tensor] = None

    def state_dict(self) -> dict:
        ref = None if self.reference is None else self.reference.detach().cpu().clone()
        return {"gathers": self.gathers, "reference": ref}

    def load_state_dict(self, state: dict) -> None:
        ref = state.get("reference")
        if ref is not None and (not isinstance(ref, torch.Tensor) or ref.dtype != torch.uint8 or ref.dim() != 1):
            raise ValueError("weights reference must be a flat uint8 tensor (a bitscom.fsdp handle state dict)")
        device = self.reference.device if self.reference is not None else None
        self.gathers = int(state["gathers"])
        self.reference = None if ref is None else ref.clone() if device is None else ref.to(device, copy=True)

    def describe(self) -> dict:
        """What every rank must agree on after a load: the count and the replica's checksum."""
        ref = self.reference
        crc = None if ref is None else (ref.numel(), zlib.crc32(ref.cpu().numpy().tobytes()))
        return {"gathers": self.gathers, "reference": crc}
