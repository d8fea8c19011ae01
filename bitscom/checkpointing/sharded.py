"""DCP checkpoints of :class:`~bitscom.ShardedOptimizer`: each rank writes its pieces and reads
the saved pieces overlapping its own, so any world size loads (docs/checkpoints.md)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Dict, List, Tuple

import torch

from .common import blob, check_extra, load_dict, read_entries, save_dict, template, unblob

__all__ = ["save_sharded", "load_sharded", "FORMAT"]

FORMAT = "bitscom.dcp.sharded/1"
_P = "bitscom.sharded/"
_META = _P + "meta"


def _span(start: int, stop: int) -> str:
    return f"{start}-{stop}"


def _state_value(name: str, key: str, value, numel: int):
    if not isinstance(value, torch.Tensor):
        return blob(value)
    if value.dim() == 0:
        return value.detach()
    if value.numel() == numel:
        return value.detach().reshape(-1)
    raise ValueError(f"optimizer state {key!r} of parameter {name!r} has shape {tuple(value.shape)}, "
                     f"neither a scalar nor one entry per element ({numel}); only elementwise "
                     "optimizer state can be checkpointed per piece")


def save_sharded(opt, path, extra=None) -> None:
    """Write ``opt``'s pieces (and ``extra``) as a DCP checkpoint; every rank calls it."""
    extra = check_extra(extra)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.optimizer.param_groups]
    state: Dict[str, Any] = {_META: blob({
        "format": FORMAT, "world": opt.topo.world, "step": opt._step_count,
        "settings": opt.config.describe(), "optimizer": type(opt.optimizer).__name__,
        "params": {n: tuple(p.shape) for n, p in opt._trainable}, "param_groups": groups})}
    for name, start, stop, view in opt.shard_pieces:
        span = _span(start, stop)
        state[f"{_P}master/{name}/{span}"] = view.detach()
        for key, value in opt.optimizer.state.get(view, {}).items():
            state[f"{_P}state/{name}/{key}/{span}"] = _state_value(name, key, value, stop - start)
    for name, p in opt._trainable:
        state[f"{_P}replica/{name}"] = p.detach()
    state.update(extra)
    save_dict(state, path, opt.topo.group)


def _saved_pieces(entries: dict):
    """{name: [(start, stop)]} and {(name, start, stop): {key: entry key}} from the key list."""
    masters: Dict[str, List[Tuple[int, int]]] = defaultdict(list)
    states: Dict[tuple, Dict[str, str]] = defaultdict(dict)
    for k in entries:
        if k.startswith(_P + "master/"):
            name, span = k[len(_P + "master/"):].rsplit("/", 1)   # names may hold '/': split from the right
            start, stop = map(int, span.split("-"))
            masters[name].append((start, stop))
        elif k.startswith(_P + "state/"):
            name, key, span = k[len(_P + "state/"):].rsplit("/", 2)
            start, stop = map(int, span.split("-"))
            states[(name, start, stop)][key] = k
    return masters, states


def _overlaps(opt, masters) -> Dict[tuple, List[Tuple[int, int]]]:
    """For each of this rank's pieces, the saved pieces that overlap it."""
    out = {}
    for name, start, stop, _ in opt.shard_pieces:
        found = [(a, b) for a, b in masters.get(name, []) if a < stop and b > start]
        if sum(min(b, stop) - max(a, start) for a, b in found) != stop - start:
            raise ValueError(f"parameter {name!r}: the checkpoint's pieces do not cover elements "
                             f"[{start}, {stop}) (an incomplete checkpoint?)")
        out[(name, start, stop)] = found
    return out


def _assemble(name: str, start: int, stop: int, found, states: dict, loaded: dict, device) -> dict:
    """This piece's optimizer state, cut from the overlapping saved pieces."""
    keys = {frozenset(states.get((name, a, b), {})) for a, b in found}
    if len(keys) != 1:
        raise ValueError(f"parameter {name!r}: saved pieces hold different optimizer state keys "
                         f"{sorted(sorted(k) for k in keys)}")
    out: Dict[str, Any] = {}
    for key in sorted(next(iter(keys))):
        first = loaded[states[(name,) + tuple(found[0])][key]]
        if not isinstance(first, torch.Tensor):
            out[key] = unblob(first)
        elif first.dim() == 0:
            out[key] = first.clone().to(device)
        else:
            piece = torch.empty(stop - start, dtype=first.dtype)
            for a, b in found:
                lo, hi = max(a, start), min(b, stop)
                piece[lo - start:hi - start] = loaded[states[(name, a, b)][key]][lo - a:hi - a]
            out[key] = piece.to(device)
    return out


def load_sharded(opt, path, extra=None, load_replicas: bool = True) -> None:
    """Load a :func:`save_sharded` checkpoint of any world size into ``opt`` (and ``extra``)."""
    extra = check_extra(extra)
    entries = read_entries(path)
    if _META not in entries:
        raise ValueError(f"{path!s} is not a bitscom ShardedOptimizer DCP checkpoint (no {_META!r} "
                         "entry); DistributedOptimizer checkpoints load into a DistributedOptimizer")
    meta = unblob(load_dict({_META: b""}, path, opt.topo.group)[_META])
    if meta.get("format") != FORMAT:
        raise ValueError(f"checkpoint format {meta.get('format')!r}, expected {FORMAT!r}")
    opt._check_checkpoint(meta["params"], len(meta["param_groups"]))
    masters, states = _saved_pieces(entries)
    overlaps = _overlaps(opt, masters)
    spans = {(name, a, b) for (name, _, _), found in overlaps.items() for a, b in found}   # saved pieces to read
    wanted = {f"{_P}master/{name}/{_span(a, b)}" for name, a, b in spans}
    wanted.update(k for span in spans for k in states.get(span, {}).values())
    request: Dict[str, Any] = {k: template(entries[k]) for k in sorted(wanted)}
    if load_replicas:
        request.update({f"{_P}replica/{n}": p.detach() for n, p in opt._trainable})
    request.update(extra)
    with torch.no_grad():
        loaded = load_dict(request, path, opt.topo.group)
        new_state: Dict[Any, Dict[str, Any]] = defaultdict(dict)
        for name, start, stop, view in opt.shard_pieces:
            found = overlaps[(name, start, stop)]
            for a, b in found:
                lo, hi = max(a, start), min(b, stop)
                view[lo - start:hi - start].copy_(loaded[f"{_P}master/{name}/{_span(a, b)}"][lo - a:hi - a])
            st = _assemble(name, start, stop, found, states, loaded, view.device)
            if st:
                new_state[view] = st
    for g, saved in zip(opt.optimizer.param_groups, meta["param_groups"]):
        g.update(saved)
    opt.optimizer.state = new_state
    opt._life.loaded(int(meta["step"]))
