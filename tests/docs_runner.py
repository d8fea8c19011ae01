"""Runs the Python blocks of the Markdown docs (tests/test_docs.py is the test; the marker
convention is documented there).

Three pieces:

* :func:`parse` cuts a Markdown file into :class:`Block` s (```python / ```py fences, with the
  ``<!-- doctest: ... -->`` marker of the line before the fence);
* :class:`Zygote`: one spawned process that imports torch and bitscom once and then forks a
  fresh child per block (or N children for ``launch N``), so a block costs milliseconds of start
  instead of seconds and nothing it does (env vars, ``bitscom.init()``, registered backends)
  reaches pytest or the next block;
* :func:`exec_program`: runs the prelude and a block's sources in a fresh namespace, compiled
  under the Markdown file's name with the block's real line numbers, so a traceback points at
  the doc line.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import sys
import traceback
from dataclasses import dataclass
from typing import Optional

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS_DIR)

MODES = ("run", "gpu", "cluster", "multirank", "launch", "continue", "skip")
_MARKER = re.compile(r"^\s*<!--\s*doctest:\s*(\S+)\s*(.*?)\s*-->\s*$")
_FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)")

PRELUDE = '''\
import torch, torch.nn as nn, torch.distributed as dist, bitscom
torch.manual_seed(0)
class Net(nn.Module):
    """A tiny model: fc1 -> relu -> fc (8 -> 16 -> 4)."""
    def __init__(self):
        super().__init__()
        self.fc1, self.fc = nn.Linear(8, 16), nn.Linear(16, 4)
    def forward(self, x):
        return self.fc(torch.relu(self.fc1(x)))
model = Net()
loader = [(torch.randn(4, 8), torch.randn(4, 4)) for _ in range(2)]
loss_fn = nn.functional.mse_loss
'''
"""What every block finds defined: torch, nn, dist, bitscom, ``Net``, a ``model = Net()``, a
``loader`` of 2 (x, y) batches and ``loss_fn`` (MSE)."""


@dataclass(frozen=True)
class Block:
    """One fenced Python block: where it is, its source and how it runs."""

    path: str           # relative to the repository root
    line: int           # 1-based line of the opening fence
    src: str
    mode: str = "run"
    arg: str = ""       # N for multirank/launch, the reason for skip

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"

    @property
    def ranks(self) -> int:
        return int(self.arg) if self.mode in ("multirank", "launch") else 1


def _marker(prev: str, where: str) -> tuple[str, str]:
    m = _MARKER.match(prev)
    if not m:
        return "run", ""
    mode, arg = m.group(1), m.group(2)
    if mode not in MODES:
        raise ValueError(f"{where}: unknown doctest marker {mode!r}; allowed: {', '.join(MODES)}")
    if mode in ("multirank", "launch") and not (arg.isdigit() and int(arg) >= 2):
        raise ValueError(f"{where}: '{mode}' needs a number of ranks >= 2, got {arg!r}")
    if mode == "skip" and not arg:
        raise ValueError(f"{where}: 'skip' must say why, e.g. <!-- doctest: skip needs ImageNet -->")
    if mode not in ("multirank", "launch", "skip") and arg:
        raise ValueError(f"{where}: '{mode}' takes no argument, got {arg!r}")
    return mode, arg


def parse_text(text: str, path: str) -> list[Block]:
    """The Python blocks of one Markdown text, in order."""
    lines = text.split("\n")
    blocks, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = len(m.group(1)), m.group(2), m.group(3).lower()
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            j += 1
        if j == len(lines):
            raise ValueError(f"{path}:{i + 1}: unclosed code fence")
        if lang in ("python", "py"):
            mode, arg = _marker(lines[i - 1] if i else "", f"{path}:{i + 1}")
            body = "\n".join(ln[indent:] if ln[:indent].strip() == "" else ln for ln in lines[i + 1:j])
            blocks.append(Block(path, i + 1, body + "\n", mode, arg))
        i = j + 1
    return blocks


def parse(path: str, root: str = ROOT) -> list[Block]:
    with open(os.path.join(root, path), encoding="utf-8") as f:
        return parse_text(f.read(), path)


def chains(blocks: list[Block]) -> list[tuple[Block, list[Block]]]:
    """Each block with the blocks it runs: itself, after the blocks it continues.

    A ``continue`` block runs in the namespace of the chain it continues (the previous block
    and its own chain), re-run from the chain's head, and with the head's mode.
    """
    out: list[tuple[Block, list[Block]]] = []
    for b in blocks:
        if b.mode == "continue":
            if not out:
                raise ValueError(f"{b.id}: 'continue' on the first Python block of the file")
            prev = out[-1][1]
            out.append((b, prev + [b]))
        else:
            out.append((b, [b]))
    return out


def compile_block(b: Block):
    """The block's code object: file name and line numbers are the Markdown's."""
    return compile("\n" * b.line + b.src, b.path, "exec")


def exec_program(program: list[tuple[str, int, str]]) -> None:
    """Run the prelude, then each (path, line, src) in one fresh namespace.

    ``sys.argv`` is the doc's name alone while it runs (a block is a script run without
    arguments, so ``parser.parse_args()`` sees none).
    """
    ns: dict = {"__name__": "__doc_block__"}
    argv = sys.argv
    sys.argv = [program[0][0] if program else "<doc>"]
    try:
        exec(compile(PRELUDE, "<doctest prelude>", "exec"), ns)
        for path, line, src in program:
            exec(compile("\n" * line + src, path, "exec"), ns)
    finally:
        sys.argv = argv


def program_of(blocks: list[Block]) -> list[tuple[str, int, str]]:
    return [(b.path, b.line, b.src) for b in blocks]


def on_rank(rank: int, world: int, program) -> None:
    """The pool worker's side of ``multirank N`` (bitscom is initialized there already).

    The global RNG, the working directory and the compressor registry (a block may
    ``register`` its own) are restored afterwards, and what the block built (optimizers, their
    hooks and process groups) is collected: the worker serves other tests next.
    """
    import gc

    import torch

    from bitscom.compressors import registry
    cwd, registered = os.getcwd(), dict(registry._REGISTRY)
    try:
        os.chdir(ROOT)
        with torch.random.fork_rng(devices=[]):
            exec_program(program)
    finally:
        os.chdir(cwd)
        registry._REGISTRY.clear()
        registry._REGISTRY.update(registered)
        gc.collect()


# ------------------------------------------------------------------ the zygote

def _child(program, env: Optional[dict], conn) -> None:
    try:
        if env:
            os.environ.update(env)
        os.chdir(ROOT)
        exec_program(program)
        if env:
            import torch.distributed as dist

            import bitscom
            if dist.is_initialized():
                # rank 0 hosts the store: leaving while a peer is still inside
                # init_process_group resets that peer's connection (seen under load)
                dist.barrier()
            bitscom.shutdown()
        conn.send(None)
    except BaseException:  # noqa: BLE001 — report everything to the parent
        conn.send(traceback.format_exc())
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def _collect(procs, conns, timeout: float) -> list[Optional[str]]:
    import time
    deadline = time.monotonic() + timeout
    out: list[Optional[str]] = []
    for r, (p, c) in enumerate(zip(procs, conns)):
        if c.poll(max(0.0, deadline - time.monotonic())):
            try:
                out.append(c.recv())
            except EOFError:
                out.append(f"rank {r}: the process died (exit code {p.exitcode})")
        else:
            out.append(f"rank {r}: no answer within {timeout:.0f}s (hang)")
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
    return out


def _fork_run(program, world: int, timeout: float) -> list[Optional[str]]:
    """Fork ``world`` children (``world > 1``: torchrun-style env, one gloo world)."""
    from distpool import free_port, worker_env
    ctx = mp.get_context("fork")
    port = free_port() if world > 1 else 0
    procs, conns = [], []
    for r in range(world):
        parent, child = ctx.Pipe()
        env = worker_env(r, world, port, world) if world > 1 else None
        p = ctx.Process(target=_child, args=(program, env, child), daemon=True)
        p.start()
        procs.append(p)
        conns.append(parent)
    return _collect(procs, conns, timeout)


def _zygote(conn) -> None:
    sys.path.insert(0, TESTS_DIR)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # CUDA cannot be used in a process forked after it was initialized: the forked blocks run
    # on CPU, as in CI, also on a GPU machine (``gpu`` blocks go to run_spawned instead).
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import torch
    torch.set_num_threads(1)
    import bitscom  # noqa: F401 — imported once, inherited by every fork
    # The first optimizer imports torch._dynamo (seconds); do it once here. No tensor math
    # runs in this process, so no thread pool exists to break the forks.
    torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    conn.send("ready")
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        if msg is None:
            break
        conn.send(_fork_run(*msg))


def run_spawned(program, timeout: float = 120) -> list[Optional[str]]:
    """Run ``program`` in one freshly spawned process (seconds to start; CUDA usable there).

    Example::

        errors = run_spawned([("docs/x.md", 3, "torch.ones(1).cuda()\n")])
    """
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_child, args=(program, None, child), daemon=True)
    p.start()
    return _collect([p], [parent], timeout)


class Zygote:
    """A spawned process with torch and bitscom imported that forks one child per block.

    Example::

        z = Zygote(); errors = z.run(program, world=1, timeout=60); z.close()
    """

    def __init__(self):
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_zygote, args=(child,))  # not a daemon: it forks
        self._proc.start()
        for _ in range(120):
            if self._conn.poll(1) or not self._proc.is_alive():
                break
        if not self._conn.poll(0):
            self.close()
            raise RuntimeError("the doc-block zygote did not start within 120 s "
                               f"(exit code {self._proc.exitcode})")
        self._conn.recv()

    def run(self, program, world: int = 1, timeout: float = 60) -> list[Optional[str]]:
        """Per-rank tracebacks (None where the rank succeeded)."""
        self._conn.send((program, world, timeout))
        if not self._conn.poll(timeout + 30):
            raise RuntimeError(f"the doc-block zygote gave no answer within {timeout + 30:.0f}s")
        return self._conn.recv()

    def close(self) -> None:
        try:
            self._conn.send(None)
        except Exception:  # noqa: BLE001
            pass
        self._proc.join(timeout=10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(timeout=5)
