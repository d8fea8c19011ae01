"""DCP checkpoints of :class:`~bitscom.DistributedOptimizer` (keys, and what loads on another
world size: docs/checkpoints.md)."""

from __future__ import annotations

import re

from ..face import own_entry
from .common import (blob, check_extra, digest, join_tensors, load_dict, read_entries, save_dict,
                     split_tensors, template, unblob)

__all__ = ["save_distributed", "load_distributed", "FORMAT"]

FORMAT = "bitscom.dcp.distributed/1"
_META = "bitscom/meta"
_RANK = re.compile(r"^bitscom/rank(\d+)/reducer$")


def _reducer_key(rank: int) -> str:
    return f"bitscom/rank{rank}/reducer"


def save_distributed(opt, path, extra=None) -> None:
    """Write ``opt``'s state (and ``extra``) as a DCP checkpoint; every rank calls it."""
    extra = check_extra(extra)
    sd = opt.state_dict()
    own = own_entry(sd.pop("bitscom"), opt._rank, map_location="cpu")   # no second copy on the GPU
    shared: list = []
    skeleton = split_tensors(sd, shared)
    mine: list = []
    reducer = split_tensors(own["reducer"], mine)
    rank, world = own["rank"], own["world"]
    state = {_META: blob({"format": FORMAT, "world": world, "steps": own["steps"],
                          "optimizer": skeleton}),
             _reducer_key(rank): blob({"skeleton": reducer, "digests": [digest(t) for t in mine]})}
    state.update({f"bitscom/optimizer/{i}": t for i, t in enumerate(shared)})
    state.update({f"{_reducer_key(rank)}/{i}": t for i, t in enumerate(mine)})
    state.update(extra)
    save_dict(state, path, opt.process_group)


def _source_rank(opt, saved_world: int, blobs: dict, reset: bool):
    """Whose compressor state this rank loads (None: start it fresh)."""
    if reset:
        return None
    if saved_world == opt._size:
        return opt._rank
    first = blobs[0]
    if all(b["digests"] == first["digests"] and b["skeleton"] == first["skeleton"]
           for b in blobs.values()):
        return 0                     # the same on every saving rank: valid on any world size
    raise ValueError(
        f"this checkpoint was written by {saved_world} ranks and holds per-rank compressor state "
        f"(error-feedback residuals that differ between ranks); this run has {opt._size} ranks, "
        "so that state cannot be resumed. Load it on the same world size to resume exactly, or "
        "pass reset_compressor_state=True to restart the compressor state from zero (the "
        "optimizer state and step count still load)")


def _fresh_reducer(opt) -> dict:
    return {"states": [opt.compression.init_state(layout).state_dict() for layout in opt.bucket_layouts]}


def load_distributed(opt, path, extra=None, reset_compressor_state: bool = False) -> None:
    """Load a :func:`save_distributed` checkpoint into ``opt`` (and ``extra`` in place)."""
    extra = check_extra(extra)
    entries = read_entries(path)
    if _META not in entries:
        raise ValueError(f"{path!s} is not a bitscom DistributedOptimizer DCP checkpoint (no "
                         f"{_META!r} entry); ShardedOptimizer checkpoints load into a ShardedOptimizer")
    saved_ranks = sorted(int(m.group(1)) for m in map(_RANK.match, entries) if m)
    wanted = [opt._rank] if (len(saved_ranks) == opt._size and not reset_compressor_state) else \
        ([] if reset_compressor_state else saved_ranks)
    first = load_dict({_META: b"", **{_reducer_key(r): b"" for r in wanted}}, path, opt.process_group)
    meta = unblob(first[_META])
    if meta.get("format") != FORMAT:
        raise ValueError(f"checkpoint format {meta.get('format')!r}, expected {FORMAT!r}")
    blobs = {r: unblob(first[_reducer_key(r)]) for r in wanted}
    source = _source_rank(opt, meta["world"], blobs, bool(reset_compressor_state))
    prefixes = ["bitscom/optimizer/"] + ([f"{_reducer_key(source)}/"] if source is not None else [])
    state = {k: template(m) for k, m in entries.items() if any(k.startswith(p) for p in prefixes)}
    state.update(extra)
    load_dict(state, path, opt.process_group)
    sd = join_tensors(meta["optimizer"], _indexed(state, "bitscom/optimizer/"))
    if source is None:
        reducer = _fresh_reducer(opt)
    else:
        reducer = join_tensors(blobs[source]["skeleton"], _indexed(state, f"{_reducer_key(source)}/"))
    sd["bitscom"] = {"reducer": reducer, "steps": meta["steps"], "rank": opt._rank, "world": opt._size}
    opt.load_state_dict(sd)


def _indexed(state: dict, prefix: str) -> dict:
    return {int(k[len(prefix):]): v for k, v in state.items()
            if k.startswith(prefix) and k[len(prefix):].isdigit()}
