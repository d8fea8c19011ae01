"""The compressors sit below the cost model and the Horovod face: no module of
``bitscom.compressors`` imports ``bitscom.cost`` or ``bitscom.horovod``, not even lazily inside a
function (issue 32: the ``registry -> auto -> cost -> compressors`` and
``hvd_adapter <-> horovod.codec`` cycles). ``Auto`` lives in :mod:`bitscom.cost.auto` and
registers itself there."""

from __future__ import annotations

import ast
import os

import bitscom

ROOT = os.path.dirname(bitscom.__file__)


def _imports(path: str, package: str):
    """Every module ``path`` imports, anywhere in the file, as absolute names."""
    tree = ast.parse(open(path).read())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                yield ".".join(base + ([node.module] if node.module else []))
            else:
                yield node.module or ""


def test_no_compressor_module_imports_the_cost_model_or_the_horovod_face():
    folder = os.path.join(ROOT, "compressors")
    bad = []
    for name in sorted(os.listdir(folder)):
        if name.endswith(".py"):
            for target in _imports(os.path.join(folder, name), "bitscom.compressors"):
                if target.startswith(("bitscom.cost", "bitscom.horovod")):
                    bad.append(f"compressors/{name} imports {target}")
    assert bad == []


def test_auto_is_registered_by_its_own_module():
    from bitscom.compressors import get
    from bitscom.cost.auto import Auto
    assert type(get("auto")) is Auto
    src = open(os.path.join(ROOT, "compressors", "registry.py")).read()
    assert "_auto" not in src and ".auto" not in src


def test_the_codec_base_class_is_one_class_under_every_name():
    import warnings

    from bitscom.compressors import hvd_adapter
    from bitscom.horovod.codec import HorovodCodec
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        assert hvd_adapter.HorovodCompressor is HorovodCodec is bitscom.compression.Compressor
