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
