"""docs/integrations.md shows the recipes' exact code: each skipped block names the file in
tests/integrations/ that it is, and must equal it byte for byte (the file is what the other
tests here run). Needs none of Accelerate, Lightning or Ray."""

import os
import re

import docs_runner

HERE = os.path.dirname(os.path.abspath(__file__))
DOC = os.path.join("docs", "integrations.md")
RECIPES = ("accelerate_ddp_hook.py", "accelerate_optimizer.py", "lightning_ddp_hook.py", "ray_train.py")


def test_doc_blocks_are_the_tested_recipes():
    named = {}
    for block in docs_runner.parse(DOC):
        m = re.search(r"tests/integrations/(\w+\.py)", block.arg)
        if m:
            named[m.group(1)] = block.src
    assert sorted(named) == sorted(RECIPES), f"{DOC} should show each recipe once: found {sorted(named)}"
    for name, src in named.items():
        with open(os.path.join(HERE, name), encoding="utf-8") as f:
            assert src == f.read(), f"{DOC}'s block for {name} differs from tests/integrations/{name}"
