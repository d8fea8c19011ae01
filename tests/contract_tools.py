"""Small pieces every face-contract suite uses (tests/test_face_contract*.py)."""

from __future__ import annotations

import datetime
import gc
import os
import threading

import torch.distributed as dist

import bitscom


def outcome(fn):
    """("ok", value) or (exception type name, message): what each rank did, to compare."""
    try:
        return ("ok", fn())
    except Exception as err:  # noqa: BLE001 — the contract compares what each rank raised
        return (type(err).__name__, str(err))


def resource_counts():
    """(process groups, threads, file descriptors) of this process, after a collection."""
    gc.collect()
    return len(dist.distributed_c10d._world.pg_map), threading.active_count(), len(os.listdir("/proc/self/fd"))


def assert_no_growth(results) -> None:
    """Each rank's (counts after cycle 2, counts after the last cycle) must be equal."""
    for first, last in results:
        assert last == first, f"(groups, threads, fds) after cycle 2 {first}, after the last {last}"


def failed_builds_then_shutdown(specs, build_and_use):
    """Build and use every face in ``specs`` with rank 1's mismatched setting, keep each error (its
    traceback keeps the half-built face alive), then shut the world down: (errors, shutdown's outcome)."""
    kept = []
    for spec in specs:
        try:
            build_and_use(spec)
        except RuntimeError as err:
            kept.append(err)
    shutdown = outcome(bitscom.shutdown)
    bitscom.init(timeout=datetime.timedelta(seconds=60))   # leave the pool a world
    return len(kept), shutdown
