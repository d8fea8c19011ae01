"""A pool of long-lived gloo worker processes per world size, shared by the whole test session.

Spawning and rendezvousing processes costs about a second per test; keeping one world of W
workers alive and sending each test's function to it keeps the suite fast. A test's
function runs on every rank with ``(rank, world_size, *args)`` and returns a picklable value;
the pool returns the list of per-rank results or raises with every failing rank's traceback.

Workers are started like torchrun would start them (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR/PORT) and call ``bitscom.init()``; a 4-rank world is laid out
as 2 nodes × 2 ranks so hierarchical code paths see two "nodes". A worker that dies or a
test that times out tears the world down; the next test gets a fresh one.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import sys
import time
import traceback

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env(rank: int, world: int, port: int, local_size: int) -> dict:
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank % local_size),
            "LOCAL_WORLD_SIZE": str(local_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def _worker(rank: int, world: int, port: int, local_size: int, conn) -> None:
    os.environ.update(worker_env(rank, world, port, local_size))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.path.insert(0, TESTS_DIR)
    import datetime

    import torch
    torch.set_num_threads(1)
    import bitscom
    bitscom.init(timeout=datetime.timedelta(seconds=60))
    conn.send(("ready", None))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        if msg is None:
            break
        fn, args, kwargs = msg
        try:
            result = fn(rank, world, *args, **kwargs)
            conn.send(("ok", result))
        except BaseException:  # noqa: BLE001 — report everything to the parent
            conn.send(("error", traceback.format_exc()))
    try:
        bitscom.shutdown()
    except Exception:  # noqa: BLE001
        pass


SPAWNED_ERROR = "__spawned_error__"


def _spawned_main(target, ready, rank, world, port, queue, release, *args) -> None:
    """Import torch and bitscom, wait until every rank has, then run ``target``.

    Under load one rank can take many seconds longer than the others just to import torch; a
    test that calls ``init(timeout=5 s)`` would then lose the rendezvous race instead of testing
    what it means to. An exception in ``target`` is put on the queue, so the test fails at once
    with the traceback instead of waiting for a result that never comes.
    """
    sys.path.insert(0, TESTS_DIR)
    import torch  # noqa: F401 — imported before the barrier, see above

    import bitscom  # noqa: F401
    try:
        ready.wait(120)
        target(rank, world, port, queue, release, *args)
    except BaseException:  # noqa: BLE001 — reported to the parent
        queue.put((SPAWNED_ERROR, rank, traceback.format_exc()))
        queue.close()
        queue.join_thread()
        os._exit(1)


def run_spawned(target, world: int, *args, results: int = None, timeout: float = 150):
    """Start ``world`` fresh processes running ``target(rank, world, port, queue, release, *args)``
    (for tests that need their own init, e.g. a short timeout or a stalled peer); collect
    ``results`` (default ``world``) items from ``queue``, then set ``release`` and make sure
    every process is gone. Returns the collected items in arrival order. Every rank has imported
    torch and bitscom before ``target`` starts; an exception in ``target`` raises here.
    """
    ctx = mp.get_context("spawn")
    queue, release, ready, port = ctx.Queue(), ctx.Event(), ctx.Barrier(world), free_port()
    procs = [ctx.Process(target=_spawned_main, args=(target, ready, r, world, port, queue, release, *args),
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    try:
        items = []
        for _ in range(world if results is None else results):
            item = queue.get(timeout=timeout)
            if isinstance(item, tuple) and len(item) == 3 and item[0] == SPAWNED_ERROR:
                raise RankError(f"rank {item[1]} failed:\n{item[2]}")
            items.append(item)
        return items
    finally:
        release.set()
        for p in procs:
            p.join(timeout=20)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)


class RankError(AssertionError):
    """A test function failed on one or more ranks."""


class WorkerPool:
    def __init__(self, world: int, local_size: int | None = None):
        self.world = world
        self.local_size = local_size or (2 if world == 4 else world)
        self.procs = []
        self.conns = []

    def start(self) -> None:
        """Start the workers; a start that fails (a worker that died while starting, e.g. a
        port taken between free_port() and the rendezvous's bind) is retried once on a new port."""
        try:
            self._start()
        except (RuntimeError, EOFError, OSError):
            self.close()
            self._start()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        port = free_port()
        for r in range(self.world):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(r, self.world, port, self.local_size, child), daemon=True)
            p.start()
            self.procs.append(p)
            self.conns.append(parent)
        for r, c in enumerate(self.conns):
            if not c.poll(120):
                self.close()
                raise RuntimeError(f"worker {r} of a {self.world}-rank pool did not start")
            c.recv()

    @property
    def alive(self) -> bool:
        return bool(self.procs) and all(p.is_alive() for p in self.procs)

    def run(self, fn, *args, timeout: float = 120, **kwargs):
        if not self.alive:
            self.close()
            self.start()
        for c in self.conns:
            c.send((fn, args, kwargs))
        results, errors = [None] * self.world, []
        for r, c in enumerate(self.conns):
            if not c.poll(timeout):
                errors.append(f"rank {r}: no answer within {timeout}s (hang)")
                continue
            try:
                status, value = c.recv()
            except EOFError:
                errors.append(f"rank {r}: worker process died")
                continue
            if status == "ok":
                results[r] = value
            else:
                errors.append(f"rank {r}:\n{value}")
        if errors:
            self.close()
            raise RankError("\n".join(errors))
        return results

    def close(self) -> None:
        self.ask_to_exit()
        self.reap()

    def ask_to_exit(self) -> None:
        """Tell every worker to leave its loop (they shut down concurrently)."""
        for c in self.conns:
            try:
                c.send(None)
            except Exception:  # noqa: BLE001
                pass

    def reap(self, grace: float = 3.0) -> None:
        """Wait up to ``grace`` seconds in all for the workers to exit, then kill the rest."""
        deadline = time.monotonic() + grace
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self.procs, self.conns = [], []


class Pools:
    """Lazily started pools keyed by world size."""

    def __init__(self):
        self._pools = {}

    def __call__(self, world: int) -> WorkerPool:
        pool = self._pools.get(world)
        if pool is None:
            pool = self._pools[world] = WorkerPool(world)
        return pool

    def run(self, world: int, fn, *args, **kwargs):
        return self(world).run(fn, *args, **kwargs)

    def close(self) -> None:
        for pool in self._pools.values():      # every world shuts down at once, not one by one
            pool.ask_to_exit()
        for pool in self._pools.values():
            pool.reap()
