"""Sharded data parallelism with SDP4Bit's communication quantization (re-exports only).

See docs/sharded.md.
"""

from .args import add_arguments, config_from_args, settings_from_args
from .config import ShardedConfig
from .gradients import Topology, gradient_wire_bytes
from .layout import ShardPlan, plan_shards
from .optimizer import ELEMENTWISE_OPTIMIZERS, ShardedOptimizer
from .weights import weight_wire_bytes

__all__ = ["ShardedOptimizer", "ShardedConfig", "ELEMENTWISE_OPTIMIZERS", "add_arguments", "settings_from_args",
           "config_from_args", "plan_shards", "ShardPlan", "Topology", "gradient_wire_bytes", "weight_wire_bytes"]
