"""The two flat collectives under their current torch names (torch 2.13 renamed them and
deprecated the old ones; 2.11 has only the old names)."""

import torch.distributed as dist

__all__ = ["all_gather_flat", "reduce_scatter_flat"]

all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
