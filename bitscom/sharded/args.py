"""The SDP4Bit Megatron-LM command-line flags, so existing launch lines keep working."""

from __future__ import annotations

import argparse

from .config import ShardedConfig

__all__ = ["add_arguments", "settings_from_args", "config_from_args"]

_D = ShardedConfig()

# (flag, ShardedConfig field, type or None for a switch, help)
_FLAGS = (
    ("--quantized-weights", "quantized_weights", None,
     "all-gather parameters as quantized weight differences (qWD)"),
    ("--weight-quantization-bits", "weight_quantization_bits", int, "bits of the weight differences"),
    ("--wq-group-size", "wq_group_size", int, "elements per scale of the weight differences"),
    ("--quantized-gradients", "quantized_gradients", None,
     "reduce-scatter gradients with two-level quantization (TLq)"),
    ("--gradient-quantization-bits-intra", "gradient_quantization_bits_intra", int,
     "bits of the intra-node gradient all-to-all (32 = float32)"),
    ("--gq-group-size-intra", "gq_group_size_intra", int, "elements per scale, intra-node stage"),
    ("--gradient-quantization-bits-inter", "gradient_quantization_bits_inter", int,
     "bits of the inter-node gradient all-to-all (32 = float32)"),
    ("--gq-group-size-inter", "gq_group_size_inter", int, "elements per scale, inter-node stage"),
    ("--hadamard-transform", "hadamard_transform", None,
     "Hadamard-smooth gradients before quantizing (TLq-HS)"),
    ("--gradient-alltoall-pipeline", "gradient_alltoall_pipeline", int,
     "chunks that overlap the intra- and inter-node all-to-alls"),
)


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--use-distributed-optimizer`` (accepted so Megatron launch lines parse; choosing
    the optimizer is your script's decision) and the SDP4Bit quantization flags to ``parser``.

    Example::

        bitscom.sharded.add_arguments(parser)
    """
    g = parser.add_argument_group("SDP4Bit sharded data parallelism (bitscom.ShardedOptimizer)")
    g.add_argument("--use-distributed-optimizer", dest="use_distributed_optimizer", action="store_true",
                   help="shard optimizer state over ranks (Megatron's distributed optimizer)")
    for flag, field, typ, text in _FLAGS:
        default = getattr(_D, field)
        if typ is None:
            g.add_argument(flag, dest=field, action="store_true", help=text)
        else:
            g.add_argument(flag, dest=field, type=typ, default=default, help=f"{text} (default {default})")
    return parser


def settings_from_args(args) -> dict:
    """Keyword arguments of :class:`~bitscom.ShardedOptimizer` from parsed flags.

    Example::

        kwargs = settings_from_args(args)   # {'quantized_weights': True, ...}
    """
    missing = [f for f, field, _, _ in _FLAGS if not hasattr(args, field)]
    if missing:
        raise ValueError(f"args lacks {missing}; call bitscom.sharded.add_arguments(parser) first")
    return {field: getattr(args, field) for _, field, _, _ in _FLAGS}


def config_from_args(args) -> ShardedConfig:
    """The validated :class:`ShardedConfig` of parsed flags.

    Example::

        cfg = config_from_args(parser.parse_args(["--quantized-weights"]))
    """
    return ShardedConfig(**settings_from_args(args))
