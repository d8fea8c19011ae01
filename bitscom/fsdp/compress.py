"""``bitscom.fsdp.compress``: turn FSDP2's gradient reduce-scatter into bitscom's low-bit one.

Every ``fully_shard``-ed submodule of the model owns one parameter group and reduce-scatters
its gradients once per backward; :func:`compress` installs one
:class:`~bitscom.fsdp.reduce_scatter.LowBitReduceScatter` per such module (its own
:class:`~bitscom.lowbit.LowBitState`, keyed by the module's name) through
``FSDPModule.set_custom_reduce_scatter``; with ``weights=`` also one
:class:`~bitscom.fsdp.weights.LowBitAllGather` per module (``set_custom_all_gather``). The
returned :class:`FSDPCompression` reports bytes and checkpoints the states.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional

import torch

from .. import runtime
from ..agreement import describe_state
from ..face import Face, describe_parameters, load_all_or_nothing, report
from ..lowbit.config import LowBitConfig
from ..lowbit.state import LowBitState
from .reduce_scatter import ByteCount, LowBitReduceScatter
from .settings import gradient_config, require_hook
from .weight_settings import weight_config
from .weights import WeightGathers

__all__ = ["FSDPCompression", "compress", "comm_stats", "handle"]

_ATTR = "_bitscom_fsdp"


def _fsdp_module_class():
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError as err:   # pragma: no cover - torch without FSDP2
        raise RuntimeError(f"bitscom.fsdp needs torch.distributed.fsdp.FSDPModule (FSDP2), which torch "
                           f"{torch.__version__} does not have; use torch 2.11 or newer") from err
    return FSDPModule


def _param_groups(module):
    """The FSDP parameter groups of ``module`` (torch 2.13: a list; 2.11/2.12: one or None)."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        one = getattr(state, "_fsdp_param_group", None)
        groups = [] if one is None else [one]
    return list(groups)


def _fsdp_params(module):
    """The module's ``FSDPParam`` list, asked at each all-gather (FSDP builds it lazily)."""
    return lambda: _param_groups(module)[0].fsdp_params


def _divide_factor(module):
    """For a torch whose PREMUL_SUM op does not carry its factor: the module's
    ``set_gradient_divide_factor`` value."""
    def factor():
        groups = _param_groups(module)
        return getattr(groups[0], "gradient_divide_factor", None) if groups else None
    return factor


def _levels(cfg: LowBitConfig, intra_group, inter_group):
    if (intra_group is None) != (inter_group is None):
        raise ValueError("pass both intra_group and inter_group, or neither")
    if cfg.hierarchy != "two_level":
        if intra_group is not None:
            raise ValueError(f"intra_group/inter_group are for hierarchy='two_level'; the config has "
                             f"hierarchy={cfg.hierarchy!r}")
        return None
    if intra_group is None:
        if not runtime.is_initialized():
            raise ValueError("hierarchy='two_level' needs the node groups: pass intra_group and "
                             "inter_group, or call bitscom.init() first")
        intra_group, inter_group = runtime.intra_group(), runtime.inter_group()
    if intra_group is None or inter_group is None:
        raise ValueError("hierarchy='two_level' needs a distributed run (bitscom.init() found one process)")
    return intra_group, inter_group


class FSDPCompression(Face):
    """What :func:`compress` installed on one model: byte counts and the per-module states.

    Attributes:
        config: the gradient settings.
        states: ``{module name: LowBitState}``, one per ``fully_shard``-ed module with parameters.
        counter: the bytes so far (:meth:`comm_stats`).
        weights: the parameter all-gathers' :class:`~bitscom.fsdp.weights.WeightGathers`
            (settings, per-module replicas, bytes), or ``None`` without ``weights=``.

    Example::

        handle = bitscom.fsdp.compress(model, gradients=4)
        ...
        handle.comm_stats()["compression_ratio"]
        torch.save(handle.state_dict(), "fsdp_lowbit.pt")
    """

    def __init__(self, config: LowBitConfig, states: Dict[str, LowBitState], counter: ByteCount,
                 process_group=None, weights: Optional[WeightGathers] = None):
        self.config, self.states, self.counter, self.weights = config, states, counter, weights
        self._face_init("bitscom.fsdp.compress", process_group, warn_single=False)
        self._reduce_scatters: List[LowBitReduceScatter] = []

    def _before(self) -> None:
        """Before each reduce-scatter: the world is alive, and after a load every rank resumed
        the same reduce-scatter count with states of the same shapes (the first reduce-scatter
        after a load is collective on every rank, so the check cannot hang)."""
        self._check_live()
        self._agree_if_resumed(lambda: {"reduce-scatters": self.counter.calls,
                                        "states": {k: describe_state(s) for k, s in sorted(self.states.items())},
                                        "weights": self.weights.describe() if self.weights else None},
                               "bitscom.fsdp resumed state")

    def _load_states(self, saved: dict) -> None:
        for name, s in self.states.items():
            s.load_state_dict(saved[name])

    def _save_all(self) -> dict:
        return {"states": {n: s.state_dict() for n, s in self.states.items()},
                "weights": self.weights.state_dict() if self.weights else None}

    def _load_all(self, state: dict) -> None:
        self._load_states(state["states"])
        if self.weights:
            self.weights.load_state_dict(state["weights"])

    def _release_groups(self) -> None:
        for rs in getattr(self, "_reduce_scatters", ()):
            rs.process_group = rs.levels = None

    def comm_stats(self) -> dict:
        """``bytes_sent`` / ``dense_bytes`` / ``compression_ratio`` of the gradient
        reduce-scatters so far (dense = FSDP's float32 reduce-scatter of the same inputs), plus
        ``reduce_scatters`` (how many were run) and, for ``hierarchy="two_level"``,
        ``inter_node_bytes`` (the part of ``bytes_sent`` that crossed the slow inter-node level).
        With ``weights=``: ``all_gather_bytes_sent`` / ``all_gather_dense_bytes`` (FSDP's own
        all-gather in its dtype) / ``all_gather_compression_ratio`` / ``all_gathers``."""
        c = self.counter
        extra = {"inter_node_bytes": c.inter_bytes} if self.config.hierarchy == "two_level" else {}
        extra.update(self.weights.stats() if self.weights else {})
        return report(c.bytes_sent, c.dense_bytes, c.bytes_sent, c.dense_bytes, reduce_scatters=c.calls, **extra)

    def reset_stats(self) -> None:
        """Start counting bytes from zero again (e.g. after warm-up)."""
        c = self.counter
        c.bytes_sent = c.dense_bytes = c.calls = c.inter_bytes = 0
        if self.weights:
            self.weights.reset_stats()

    def state_dict(self) -> dict:
        """Step counters and error-feedback residuals, per module (this rank's; every rank saves
        its own, like an optimizer's sharded state); with ``weights=`` also each module's gather
        count and replica (``"weights"``), so a resume continues bitwise."""
        return {"config": repr(self.config), "states": {k: s.state_dict() for k, s in self.states.items()},
                "calls": self.counter.calls, **self._envelope(self.counter.calls),
                **({"weights": self.weights.state_dict()} if self.weights else {})}

    def load_state_dict(self, state: dict) -> None:
        """Restore this rank's own :meth:`state_dict`; the modules and settings must be the same.
        Another rank's state, or another step's on one rank, is the same error on every rank at
        the next reduce-scatter (loading it would resume, but not reproduce the run)."""
        if not isinstance(state, dict) or "states" not in state:
            raise ValueError("not a bitscom.fsdp handle state dict (no 'states' entry)")
        if state.get("config") != repr(self.config):
            raise ValueError(f"checkpoint was written with {state.get('config')}, this model is "
                             f"compressed with {self.config!r}")
        saved = state["states"]
        if set(saved) != set(self.states):
            raise ValueError(f"checkpoint has FSDP modules {sorted(saved)}, this model {sorted(self.states)}")
        if self.weights:
            self.weights.check(state.get("weights"))
        self._mark_loaded()                   # the next collective compares the ranks
        if not self._check_envelope(state, per_rank_state=True):
            return
        load_all_or_nothing(self._save_all, lambda: self._load_all(state), self._load_all)
        self.counter.calls = int(state.get("calls", self.counter.calls))


def compress(module: torch.nn.Module, gradients=None, weights=None, process_group=None, *,
             intra_group=None, inter_group=None) -> FSDPCompression:
    """Send the gradient reduce-scatters of a ``fully_shard``-ed (FSDP2) model in low bit.

    Call it on every rank (it checks that all ranks pass the same settings and sharded the same
    modules, and raises the same error on every rank otherwise), after ``fully_shard`` (every
    submodule you sharded, and the root) and before the first backward. Each sharded module's reduce-scatter is replaced by bitscom's: ``"none"``
    hierarchy = the flat low-bit reduce-scatter (quantize P shards -> one all-to-all -> sum in
    float32), ``"two_level"`` = SDP4Bit's intra-node then inter-node level-wise one. FSDP's
    averaging (``AVG``, ``set_gradient_divide_factor``, fp16 pre/post division) is honoured.

    Args:
        module: the root module (an ``FSDPModule``); every ``FSDPModule`` under it is compressed.
        gradients: a :class:`~bitscom.lowbit.LowBitConfig` or an int bit width (default
            ``LowBitConfig()``: 4 bits, blocks of 128). ``bitwidth=32`` is an exact float32 path.
        weights: the parameter all-gather in low bit (``FSDPModule.set_custom_all_gather``): a
            :class:`~bitscom.fsdp.WeightConfig` or an int bit width; ``WeightConfig()`` is
            ZeRO++'s blockwise 8-bit qwZ, ``WeightConfig(mode="difference")`` SDP4Bit's 4-bit
            weight differences. Every rank, the owner of a shard included, computes with the
            dequantized parameters. ``None`` (default): FSDP's own all-gather.
        process_group: where the collectives run (default: FSDP's shard group); it must have
            the same ranks in the same order as FSDP's group (checked on the first backward).
        intra_group, inter_group: the node groups of ``hierarchy="two_level"`` (default:
            :func:`bitscom.intra_group` / :func:`bitscom.inter_group`).

    Example::

        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        handle = bitscom.fsdp.compress(model, gradients=LowBitConfig(bitwidth=4, error_feedback=True))
        loss.backward(); opt.step()
        bitscom.fsdp.comm_stats(model)   # {'bytes_sent': ..., 'dense_bytes': ..., 'compression_ratio': ...}
    """
    cfg = gradient_config(LowBitConfig() if gradients is None else gradients)
    wcfg = None if weights is None else weight_config(weights)
    levels = _levels(cfg, intra_group, inter_group)
    FSDPModule = _fsdp_module_class()
    require_hook(FSDPModule, "set_custom_reduce_scatter")
    if wcfg is not None:
        require_hook(FSDPModule, "set_custom_all_gather")
    if not isinstance(module, FSDPModule):
        raise TypeError(f"module must be an FSDP2 module (call torch.distributed.fsdp.fully_shard on it "
                        f"first), got {type(module).__name__}")
    if getattr(module, _ATTR, None) is not None:
        raise RuntimeError("this model is already compressed by bitscom.fsdp.compress; use the handle "
                           "it returned (or bitscom.fsdp.handle(model))")
    names = [name for name, sub in module.named_modules() if isinstance(sub, FSDPModule) and _param_groups(sub)]
    states: Dict[str, LowBitState] = {name: LowBitState() for name in names}
    gathers = None if wcfg is None else WeightGathers(wcfg, names)
    compression = FSDPCompression(cfg, states, ByteCount(), process_group, gathers)
    # Ranks with other settings (bit width, error feedback, hierarchy), other sharded modules or
    # other parameter shapes would exchange bytes of different formats or sizes: a gloo abort,
    # or silently mixed bytes (error feedback on one rank only). The same error on every rank.
    fields = {f"gradients.{f.name}": repr(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    fields["weights"] = repr(wcfg)
    compression._face_agree({**fields, "sharded modules": names,
                             "parameters": describe_parameters(list(module.named_parameters()))},
                            what="bitscom.fsdp.compress settings")
    for name, sub in module.named_modules():
        if name not in names:
            continue
        rs = LowBitReduceScatter(cfg, name, states[name], compression.counter, process_group, levels,
                                 _divide_factor(sub), before=compression._before)
        compression._reduce_scatters.append(rs)
        sub.set_custom_reduce_scatter(rs)
        if gathers is not None:
            gathers.install(name, sub, _fsdp_params(sub), compression._before)
    setattr(module, _ATTR, compression)
    return compression


def handle(module: torch.nn.Module) -> FSDPCompression:
    """The :class:`FSDPCompression` :func:`compress` installed on ``module``.

    Example::

        bitscom.fsdp.handle(model).state_dict()
    """
    found: Optional[FSDPCompression] = getattr(module, _ATTR, None)
    if found is None:
        raise RuntimeError(f"{type(module).__name__} is not compressed; call bitscom.fsdp.compress(model) first")
    return found


def comm_stats(module: torch.nn.Module) -> dict:
    """The byte report of a compressed model (:meth:`FSDPCompression.comm_stats`).

    Example::

        bitscom.fsdp.comm_stats(model)["compression_ratio"]   # ~7 for 4-bit blocks of 128
    """
    return handle(module).comm_stats()
