"""``bitscom.fsdp.compress``: bitscom's collectives installed on every ``fully_shard``-ed module."""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from .. import runtime
from ..agreement import describe_state
from ..face import Face, describe_parameters, load_all_or_nothing, report
from ..lowbit.config import LowBitConfig
from ..lowbit.state import LowBitState
from ..validate import instance
from .reduce_scatter import ByteCount, LowBitReduceScatter
from .replicate import HSDPBytes, ReplicateAllReduce, native_hsdp, replicate_config
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


def _group_attr(module, name: str, default):
    """A callable reading FSDP's parameter-group attribute ``name`` at call time."""
    def read():
        groups = _param_groups(module)
        return getattr(groups[0], name, default) if groups else default
    return read


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
        config, replicate: the reduce-scatter and HSDP replicate settings (``None``: not ours).
        states, replicate_states: ``{module name: LowBitState}`` of each.
        counter, hsdp: the bytes so far (:meth:`comm_stats`).
        weights: the parameter all-gathers' :class:`~bitscom.fsdp.weights.WeightGathers` or ``None``.

    Example::

        handle = bitscom.fsdp.compress(model, gradients=4)
        ...
        handle.comm_stats()["compression_ratio"]
        torch.save(handle.state_dict(), "fsdp_lowbit.pt")
    """

    def __init__(self, config: Optional[LowBitConfig], states: Dict[str, LowBitState], counter: ByteCount,
                 process_group=None, *, replicate: Optional[LowBitConfig] = None,
                 replicate_states: Optional[Dict[str, LowBitState]] = None, weights: Optional[WeightGathers] = None):
        self.config, self.states, self.counter, self.weights = config, states, counter, weights
        self.replicate = replicate                      # HSDP: the replicate all-reduce settings
        self.replicate_states: Dict[str, LowBitState] = replicate_states or {}
        self.hsdp = HSDPBytes()
        self._face_init("bitscom.fsdp.compress", process_group, warn_single=False)
        self._reduce_scatters: List[LowBitReduceScatter] = []
        self._all_reduces: List[ReplicateAllReduce] = []

    def _before(self) -> None:
        """Before each collective: the world is alive, and after a load every rank resumed alike."""
        self._check_live()
        self._agree_if_resumed(lambda: {"reduce-scatters": self.counter.calls, "all-reduces": self.hsdp.all_reduces,
                                        "states": {k: describe_state(s) for k, s in sorted(self.states.items())},
                                        "replicate states": {k: describe_state(s) for k, s in
                                                             sorted(self.replicate_states.items())},
                                        "weights": self.weights.describe() if self.weights else None},
                               "bitscom.fsdp resumed state")

    def _steps(self) -> int:
        """Backward passes reduced so far (the checkpoint envelope's step)."""
        return self.counter.calls if self.config is not None else self.hsdp.all_reduces

    def _load_states(self, saved: dict) -> None:
        for name, s in self.states.items():
            s.load_state_dict(saved["states"][name])
        for name, s in self.replicate_states.items():
            s.load_state_dict(saved["replicate"][name])
        if self.weights:
            self.weights.load_state_dict(saved["weights"])

    def _current(self) -> dict:
        return {"states": {n: s.state_dict() for n, s in self.states.items()},
                "replicate": {n: s.state_dict() for n, s in self.replicate_states.items()},
                **({"weights": self.weights.state_dict()} if self.weights else {})}

    def _release_groups(self) -> None:
        for rs in getattr(self, "_reduce_scatters", ()):
            rs.process_group = rs.levels = None
        for ar in getattr(self, "_all_reduces", ()):
            ar.group = ar.shard_group = None

    def comm_stats(self) -> dict:
        """Bytes against FSDP's own collectives: the reduce-scatters, HSDP's hops, the all-gathers."""
        c = self.counter
        gathers = self.weights.stats() if self.weights else {}
        if self.replicate is not None or self.config is None:
            return {**self._hsdp_stats(), **gathers}
        extra = {"inter_node_bytes": c.inter_bytes} if self.config.hierarchy == "two_level" else {}
        return report(c.bytes_sent, c.dense_bytes, c.bytes_sent, c.dense_bytes, reduce_scatters=c.calls,
                      **extra, **gathers)

    def _hsdp_stats(self) -> dict:
        """HSDP: both hops apart, each with its float32 baseline; ``bytes_sent`` is their sum."""
        c, h = self.counter, self.hsdp
        intra, intra_dense = (c.bytes_sent, c.dense_bytes) if self.config is not None else (h.intra_sent, h.intra_dense)
        sent, dense = intra + h.inter_sent, intra_dense + h.inter_dense
        return report(sent, dense, sent, dense, intra_node_bytes=intra, intra_node_dense_bytes=intra_dense,
                      inter_node_bytes=h.inter_sent, inter_node_dense_bytes=h.inter_dense,
                      inter_node_ratio=h.inter_dense / h.inter_sent if h.inter_sent else float("nan"),
                      reduce_scatters=c.calls if self.config is not None else h.all_reduces, all_reduces=h.all_reduces)

    def reset_stats(self) -> None:
        """Start counting bytes from zero again (e.g. after warm-up)."""
        c = self.counter
        c.bytes_sent = c.dense_bytes = c.calls = c.inter_bytes = 0
        h = self.hsdp
        h.intra_sent = h.intra_dense = h.inter_sent = h.inter_dense = 0
        if self.weights:
            self.weights.reset_stats()

    def state_dict(self) -> dict:
        """This rank's step counters, residuals and replicas, per module: a resume continues bitwise."""
        return {"config": self._config_text(), **self._current(), "calls": self.counter.calls,
                "all_reduces": self.hsdp.all_reduces, **self._envelope(self._steps())}

    def checkpoint_layout(self) -> str:
        """What a checkpoint of this handle's per-rank state is only valid for.

        Example::

            handle.checkpoint_layout()   # "world=4 replicate=2 modules=['0', '2'] settings=..."
        """
        group = self._all_reduces[0].group if self._all_reduces else None
        replicas = dist.get_world_size(group) if group is not None else 1
        world = dist.get_world_size() if dist.is_initialized() else 1
        return (f"world={world} replicate={replicas} modules={sorted(set(self.states) | set(self.replicate_states))} "
                f"settings={self._config_text()}")

    def _config_text(self) -> str:
        return repr(self.config) + ("" if self.replicate is None else f"; replicate={self.replicate!r}")

    def load_state_dict(self, state: dict) -> None:
        """Restore this rank's own :meth:`state_dict` (same modules and settings)."""
        if not isinstance(state, dict) or "states" not in state:
            raise ValueError("not a bitscom.fsdp handle state dict (no 'states' entry)")
        if state.get("config") != self._config_text():
            raise ValueError(f"checkpoint was written with {state.get('config')}, this model is "
                             f"compressed with {self._config_text()}")
        saved = {"states": state["states"], "replicate": state.get("replicate", {}), "weights": state.get("weights")}
        for part, mine in (("states", self.states), ("replicate", self.replicate_states)):
            if set(saved[part]) != set(mine):
                raise ValueError(f"checkpoint has FSDP modules {sorted(saved[part])}, this model {sorted(mine)}")
        if self.weights:
            self.weights.check(saved["weights"])
        self._mark_loaded()                   # the next reduce-scatter compares the ranks
        if not self._check_envelope(state, per_rank_state=True):
            return
        load_all_or_nothing(self._current, lambda: self._load_states(saved), self._load_states)
        self.counter.calls = int(state.get("calls", self.counter.calls))
        self.hsdp.all_reduces = int(state.get("all_reduces", self.hsdp.all_reduces))


def compress(module: torch.nn.Module, gradients=None, weights=None, process_group=None, *,
             intra_group=None, inter_group=None, replicate=None, replicate_group=None) -> FSDPCompression:
    """Send the gradient reduce-scatters of a ``fully_shard``-ed (FSDP2) model in low bit, and
    under HSDP the replicate (inter-node) all-reduce.

    Call it on every rank (the ranks check they agree), after ``fully_shard`` on every module
    and the root, before the first backward.

    Args:
        gradients: a :class:`~bitscom.lowbit.LowBitConfig` or an int bit width (default 4 bits;
            under HSDP FSDP's own exact reduce-scatter).
        weights: a :class:`~bitscom.fsdp.WeightConfig` or an int bit width (default FSDP's own).
        process_group: where the collectives run (FSDP's ranks, in FSDP's order).
        intra_group, inter_group: the node groups of ``hierarchy="two_level"``.
        replicate, replicate_group: HSDP's replicate all-reduce settings and group; the model
            must be ``fully_shard``-ed on ``mesh["shard"]``.

    Example::

        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        handle = bitscom.fsdp.compress(model, gradients=LowBitConfig(bitwidth=4, error_feedback=True))
        loss.backward(); opt.step()
        bitscom.fsdp.comm_stats(model)   # {'bytes_sent': ..., 'dense_bytes': ..., 'compression_ratio': ...}
    """
    hsdp = replicate_group is not None
    cfg, rcfg = _settings(gradients, replicate, hsdp)
    wcfg = None if weights is None else weight_config(weights)
    levels = _levels(cfg, intra_group, inter_group) if cfg is not None else None
    names = _check_module(module, hsdp, wcfg is not None)
    states: Dict[str, LowBitState] = {name: LowBitState() for name in names} if cfg is not None else {}
    compression = FSDPCompression(cfg, states, ByteCount(), process_group, replicate=rcfg,
                                  replicate_states={name: LowBitState() for name in names} if hsdp else None,
                                  weights=None if wcfg is None else WeightGathers(wcfg, names))
    # Other settings, modules or shapes on one rank: a gloo abort or silently mixed bytes.
    compression._face_agree({**_fields(cfg, rcfg, replicate_group), "weights": repr(wcfg), "sharded modules": names,
                             "parameters": describe_parameters(list(module.named_parameters()))},
                            what="bitscom.fsdp.compress settings")
    for name, sub in module.named_modules():
        if name in names:
            _install(sub, name, compression, levels, process_group, replicate_group)
    setattr(module, _ATTR, compression)
    return compression


def _settings(gradients, replicate, hsdp: bool):
    """(reduce-scatter config or None for FSDP's exact one, replicate config or None)."""
    if replicate is not None and not hsdp:
        raise ValueError("replicate= sets HSDP's replicate all-reduce; pass replicate_group= too "
                         "(mesh.get_group('replicate'))")
    cfg = None if hsdp and gradients is None else gradient_config(LowBitConfig() if gradients is None else gradients)
    return cfg, (replicate_config(replicate) if hsdp else None)


def _fields(cfg, rcfg, replicate_group) -> dict:
    """The settings every rank must share, by name."""
    fields: Dict[str, Any] = {} if cfg is None else \
        {f"gradients.{f.name}": repr(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if rcfg is not None:
        fields.update({f"replicate.{f.name}": repr(getattr(rcfg, f.name)) for f in dataclasses.fields(rcfg)})
        fields["replicate ranks"] = dist.get_world_size(replicate_group)
    return fields


def _install(sub, name: str, compression: "FSDPCompression", levels, process_group, replicate_group) -> None:
    """Hook one sharded module: bitscom's reduce-scatter and/or the HSDP replicate all-reduce."""
    cfg, rcfg = compression.config, compression.replicate
    divide = _group_attr(sub, "gradient_divide_factor", None)
    if cfg is not None:
        rs = LowBitReduceScatter(cfg, name, compression.states[name], compression.counter, process_group,
                                 levels, divide, before=compression._before)
        compression._reduce_scatters.append(rs)
        sub.set_custom_reduce_scatter(rs)
    if rcfg is not None:
        ar = ReplicateAllReduce(rcfg, name, compression.replicate_states[name], compression.hsdp, replicate_group,
                                _shard_group(sub), divide, count_reduce_scatter=cfg is None,
                                before=None if cfg is not None else compression._before,
                                requires_all_reduce=_group_attr(sub, "all_reduce_grads", True))
        compression._all_reduces.append(ar)
        sub.set_all_reduce_hook(ar)
    if compression.weights is not None:
        compression.weights.install(name, sub, _fsdp_params(sub), compression._before)


def _shard_group(module):
    """FSDP's shard group of ``module`` (its parameters' 1-D mesh)."""
    for p in module.parameters():
        mesh = getattr(p, "device_mesh", None)
        if mesh is not None:
            return mesh.get_group()
    raise ValueError(f"{type(module).__name__} has no sharded (DTensor) parameters")


def _check_module(module, hsdp: bool, weights: bool) -> list:
    """The names of the sharded modules with parameters; clear errors for what cannot work."""
    FSDPModule = _fsdp_module_class()
    require_hook(FSDPModule, "set_all_reduce_hook" if hsdp else "set_custom_reduce_scatter")
    if weights:
        require_hook(FSDPModule, "set_custom_all_gather")
    instance("module", module, FSDPModule, "an FSDP2 module (call torch.distributed.fsdp.fully_shard on it first)")
    if getattr(module, _ATTR, None) is not None:
        raise RuntimeError("this model is already compressed by bitscom.fsdp.compress; use the handle "
                           "it returned (or bitscom.fsdp.handle(model))")
    if hsdp and native_hsdp(module):
        raise ValueError(
            "replicate_group= needs the model fully_shard-ed over the shard dimension only "
            "(fully_shard(m, mesh=mesh['shard'])): it was sharded on a 2-D mesh (native HSDP), where "
            f"FSDP runs its own float32 replicate all-reduce and torch {torch.__version__} offers no "
            "public hook that replaces it (set_requires_all_reduce(False) also skips writing the "
            "gradient; set_all_reduce_hook runs after the native all-reduce)")
    return [name for name, sub in module.named_modules() if isinstance(sub, FSDPModule) and _param_groups(sub)]


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
