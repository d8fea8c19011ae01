"""Every Python block of README.md and docs/*.md runs (or at least compiles), so the docs stay true.

Each ```python (or ```py) fenced block is one test case, named ``<file>:<line of the fence>``.
A block runs in a fresh namespace after a small prelude (``docs_runner.PRELUDE``)::

    import torch, torch.nn as nn, torch.distributed as dist, bitscom
    torch.manual_seed(0)
    class Net(nn.Module): ...      # fc1 (8 -> 16), relu, fc (16 -> 4)
    model = Net()
    loader = [(x, y), (x, y)]      # 2 batches: x (4, 8), y (4, 4)
    loss_fn = nn.functional.mse_loss

with the repository root as the working directory and ``sys.argv`` holding only the doc's
name. Anything else a block uses it defines itself. By default a block runs in one fresh
process (forked from a process that imported torch and bitscom once, so nothing it does reaches
pytest or the next block; CUDA hidden, so it runs on CPU as in CI) with no launcher variables:
``bitscom.init()`` is a world of one.

Markers: an HTML comment on the line right before the opening fence (invisible when rendered)::

    <!-- doctest: multirank N -->  run on N gloo ranks of the tests' worker pools (the ``pools``
                                   fixture); bitscom.init() has run there, so the block may call
                                   it again (harmless) but not init_process_group
    <!-- doctest: launch N -->     run on N fresh processes with torchrun's variables (RANK,
                                   WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, ...) and nothing started:
                                   for blocks that call init_process_group / bitscom.init(bitwidth=...)
    <!-- doctest: continue -->     run after the previous block of the same file, in its namespace
                                   and with its mode (the chain is re-run from its first block)
    <!-- doctest: gpu -->          needs CUDA: compiled everywhere, run (in a freshly spawned
                                   process) when CUDA is available
    <!-- doctest: cluster -->      needs a real cluster / launcher / data: compiled only
    <!-- doctest: skip REASON -->  compiled only; the reason is required

An unknown marker, a missing rank count or a skip without a reason fails collection.

``KNOWN_FAILURES`` lists blocks of docs other people are editing that fail today, each an
``xfail(strict=True)`` with the fix: when the doc is fixed the test XPASSes, fails, and the
entry must go (``test_known_failures_are_current`` also fails for an entry that matches no
block any more).
"""

from __future__ import annotations

import glob
import os

import pytest
import torch

import docs_runner as R

DOC_FILES = ["README.md"] + sorted(os.path.relpath(p, R.ROOT) for p in glob.glob(os.path.join(R.ROOT, "docs", "*.md")))

# (file, a line the failing block contains) -> why it fails and the fix. Matched by content,
# not line number, so edits elsewhere in the file do not move the mark.
_MR2 = "add <!-- doctest: multirank 2 --> before the fence"
KNOWN_FAILURES: dict[tuple[str, str], str] = {
}


def _known(block: R.Block):
    hits = [why for (path, needle), why in KNOWN_FAILURES.items() if path == block.path and needle in block.src]
    return hits[0] if hits else None


def _cases():
    out = []
    for path in DOC_FILES:
        for block, chain in R.chains(R.parse(path)):
            why = _known(block)
            marks = [pytest.mark.xfail(strict=True, reason=why)] if why else []
            out.append(pytest.param(block, chain, id=block.id, marks=marks))
    return out


@pytest.fixture(scope="module")
def zygote():
    z = R.Zygote()
    yield z
    z.close()


def _raise_if_failed(block: R.Block, errors) -> None:
    bad = [f"rank {r}:\n{e}" if len(errors) > 1 else e for r, e in enumerate(errors) if e]
    if bad:
        pytest.fail(f"{block.id} ({block.mode}) failed:\n" + "\n".join(bad), pytrace=False)


@pytest.mark.parametrize("block,chain", _cases())
def test_doc_block(block, chain, zygote, pools):
    for b in chain:
        R.compile_block(b)                 # every block compiles, whatever its marker
    head = chain[0]
    mode = head.mode
    program = R.program_of(chain)
    if mode == "gpu" and torch.cuda.is_available():
        _raise_if_failed(block, R.run_spawned(program, timeout=180))
        return
    if mode in ("gpu", "cluster", "skip"):
        return
    if mode == "multirank":
        pools.run(head.ranks, R.on_rank, program, timeout=90)
        return
    world = head.ranks if mode == "launch" else 1
    _raise_if_failed(block, zygote.run(program, world=world, timeout=90))


def test_every_doc_file_is_scanned():
    blocks = [b for path in DOC_FILES for b in R.parse(path)]
    assert {"README.md", "docs/api.md", "docs/compressors.md", "docs/format.md"} <= {b.path for b in blocks}
    assert len(blocks) >= 20, f"only {len(blocks)} Python blocks found: is the parser broken?"


def test_known_failures_are_current():
    """Every KNOWN_FAILURES entry matches exactly one block: a fixed doc must drop its entry."""
    blocks = [b for path in DOC_FILES for b in R.parse(path)]
    for (path, needle), _ in KNOWN_FAILURES.items():
        hits = [b.id for b in blocks if b.path == path and needle in b.src]
        assert len(hits) == 1, f"KNOWN_FAILURES entry {(path, needle)!r} matches {hits or 'no block'}"


# ------------------------------------------------------------------ the parser itself

_DOC = """\
Some text.

```python
a = 1
```

<!-- doctest: continue -->
```py
b = a + 1
```

```bash
not python
```

<!-- doctest: multirank 2 -->
   ```python
   c = 3
   ```

<!-- doctest: skip needs ImageNet -->
```python
load_imagenet()
```
"""


def test_parse_blocks_markers_and_lines():
    blocks = R.parse_text(_DOC, "x.md")
    assert [(b.line, b.mode, b.arg, b.src) for b in blocks] == [
        (3, "run", "", "a = 1\n"), (8, "continue", "", "b = a + 1\n"),
        (17, "multirank", "2", "c = 3\n"), (22, "skip", "needs ImageNet", "load_imagenet()\n")]
    chained = R.chains(blocks)
    assert [b.line for b in chained[1][1]] == [3, 8]
    assert blocks[2].ranks == 2 and blocks[0].ranks == 1


def test_line_numbers_point_at_the_doc():
    block = R.parse_text("text\n\n```python\nx = 1\nraise ValueError(x)\n```\n", "x.md")[0]
    with pytest.raises(ValueError) as info:
        exec(R.compile_block(block), {})
    assert info.traceback[-1].lineno + 1 == 5      # pytest's lineno is 0-based: line 5 of x.md


@pytest.mark.parametrize("marker,message", [
    ("<!-- doctest: gpus -->", "unknown doctest marker 'gpus'"),
    ("<!-- doctest: skip -->", "'skip' must say why"),
    ("<!-- doctest: multirank -->", "needs a number of ranks >= 2"),
    ("<!-- doctest: launch 1 -->", "needs a number of ranks >= 2"),
    ("<!-- doctest: gpu now -->", "'gpu' takes no argument"),
])
def test_bad_markers_are_refused(marker, message):
    with pytest.raises(ValueError, match=message):
        R.parse_text(f"{marker}\n```python\nx = 1\n```\n", "x.md")


def test_continue_needs_a_previous_block_and_fences_must_close():
    with pytest.raises(ValueError, match="'continue' on the first Python block"):
        R.chains(R.parse_text("<!-- doctest: continue -->\n```python\nx = 1\n```\n", "x.md"))
    with pytest.raises(ValueError, match="unclosed code fence"):
        R.parse_text("```python\nx = 1\n", "x.md")


def test_a_block_cannot_leak_into_pytest(zygote):
    """Env vars, init() and globals set by a block stay in its forked child."""
    program = [("x.md", 1, "import os\nos.environ['BITSCOM_DOCTEST_LEAK'] = '1'\nbitscom.init()\n")]
    assert zygote.run(program) == [None]
    assert "BITSCOM_DOCTEST_LEAK" not in os.environ
    errors = zygote.run([("x.md", 1, "import os\nassert 'BITSCOM_DOCTEST_LEAK' not in os.environ\n")])
    assert errors == [None]
    errors = zygote.run([("x.md", 4, "raise KeyError('boom')\n")])
    assert 'File "x.md", line 5' in errors[0] and "KeyError: 'boom'" in errors[0]


def test_spawned_run_reports_the_doc_line():
    """The path ``gpu`` blocks take on a CUDA machine (here without CUDA: any program)."""
    src = "import sys\nassert sys.argv == ['x.md'] and model.fc.out_features == 4\nraise KeyError('gpu')\n"
    errors = R.run_spawned([("x.md", 2, src)])      # one spawn: the asserts pass, then it raises
    assert 'File "x.md", line 5' in errors[0] and "KeyError: 'gpu'" in errors[0], errors


# ------------------------------------------------------------------ defaults quoted in tables

def _table(path: str, header: str) -> list[list[str]]:
    """The rows (cells) of the Markdown table whose header line starts with ``header``."""
    with open(os.path.join(R.ROOT, path), encoding="utf-8") as f:
        lines = f.read().split("\n")
    start = next(i for i, ln in enumerate(lines) if ln.startswith(header))
    rows = []
    for ln in lines[start + 2:]:
        if not ln.startswith("|"):
            break
        rows.append([c.strip() for c in ln.strip().strip("|").split("|")])
    return rows


def test_compressor_table_defaults_are_the_code_defaults():
    """docs/compressors.md's "class (defaults)" column: ``get(name)`` equals the quoted call."""
    import re

    import bitscom.compressors as C
    checked = 0
    for cells in _table("docs/compressors.md", "| name | class (defaults) |"):
        name = re.findall(r"`(\w+)`", cells[0])[0]
        quoted = re.findall(r"`([^`]+)`", cells[1])[0]
        if name == "exclude":        # no default inner: compare the quoted patterns
            want = eval(re.search(r"patterns=(\([^)]*\))", quoted).group(1))
            assert C.Exclude.__dataclass_fields__["patterns"].default == want
        else:
            assert C.get(name) == eval(quoted, vars(C)), f"{name}: the docs say {quoted}, the code {C.get(name)}"
        checked += 1
    assert checked >= 8


def test_low_rank_default_rank_and_start_iter_as_documented():
    """The ACP-SGD / PowerSGD defaults quoted in docs/compressors.md's low-rank tables."""
    import re

    from bitscom.compressors import ACPSGD, PowerSGD
    rows = {c[0]: c for c in _table("docs/compressors.md", "| | PowerSGD (Vogels")}
    first_int = lambda cell: int(re.match(r"\s*(\d+)", cell).group(1))
    assert (first_int(rows["default rank"][1]), first_int(rows["default rank"][2])) == \
        (PowerSGD().rank, ACPSGD().rank)
    knobs = {c[0]: c[1] for c in _table("docs/compressors.md", "| knob | default | trade-off |")}
    assert knobs["`rank`"] == f"{PowerSGD().rank} / {ACPSGD().rank}"
    assert knobs["`start_iter`"] == f"{PowerSGD().start_iter} / {ACPSGD().start_iter}"


def _registered_and_seed(rank, world):
    import bitscom.compressors
    return "doc_tmp" in bitscom.compressors.names(), torch.initial_seed(), os.getcwd()


def test_a_multirank_block_leaves_the_pool_worker_as_it_was(pools):
    before = pools.run(2, _registered_and_seed)
    program = [("x.md", 1, "import os\nfrom bitscom.compressors import register, TopK\n"
                "register('doc_tmp', TopK)\ntorch.manual_seed(123)\nos.chdir('/')\n")]
    pools.run(2, R.on_rank, program)
    assert pools.run(2, _registered_and_seed) == before
    assert not any(registered for registered, _, _ in before)
