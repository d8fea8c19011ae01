import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from distpool import Pools  # noqa: E402


@pytest.fixture(scope="session")
def pools():
    """``pools.run(world_size, fn, *args)`` runs ``fn(rank, world_size, *args)`` on every rank."""
    p = Pools()
    yield p
    p.close()


@pytest.fixture(scope="module")
def own_pool():
    """A private 2-rank pool for a module whose tests shut the world down and start it again
    (the face-contract suites)."""
    from distpool import WorkerPool
    p = WorkerPool(2)
    yield p
    p.close()
