"""tests/integrations run when asked for by path (``pytest tests/integrations``, which
scripts/test_integrations.sh does), not as part of the whole suite: they start 2-rank
Accelerate and Lightning jobs that take ~40 s on a quiet 2-core machine (~2 min busy), mostly importing torch and
Lightning in every rank, and a local Ray instance with two 2-worker TorchTrainer runs (see
docs/integrations.md for its time). test_docs_recipes.py (no launch, no extra packages) always runs."""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
ALWAYS = {"test_docs_recipes.py"}


def _asked_for(config) -> bool:
    for arg in config.args:
        path = os.path.realpath(str(arg).split("::")[0])
        if path == HERE or path.startswith(HERE + os.sep):
            return True
    return False


def pytest_ignore_collect(collection_path, config):
    name = os.path.basename(str(collection_path))
    if name.startswith("test_") and name not in ALWAYS and not _asked_for(config):
        return True
    return None
