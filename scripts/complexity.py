"""Fail when a function of bitscom/ is more complex than 15 by radon's count (DESIGN.md, Style).

Why radon and not only ruff's C90: McCabe as ruff counts it ignores ``and`` / ``or``, so a
constructor of 32 radon branches passed CI. Radon counts every boolean operator. Why not
``xenon``: its ranks are radon's letters (C is 11-20), which cannot say "at most 15".

No exceptions: every function of the library is within the limit.

    python scripts/complexity.py            # what scripts/test.sh runs
"""
from __future__ import annotations

import pathlib
import sys

from radon.complexity import cc_visit
from radon.visitors import Class

LIMIT = 15
ROOT = pathlib.Path(__file__).resolve().parent.parent


def blocks(path: pathlib.Path):
    """(name, complexity) of every function and method in ``path``, closures included."""
    def walk(items, prefix=""):
        for item in items:
            if isinstance(item, Class):
                continue
            name = prefix + item.fullname
            yield name, item.complexity
            yield from walk(item.closures, f"{name}.")

    yield from walk(cc_visit(path.read_text()))


def main() -> int:
    over = []
    for path in sorted((ROOT / "bitscom").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        over += [f"{rel}:{name} has complexity {score} (at most {LIMIT}): split it into named steps"
                 for name, score in blocks(path) if score > LIMIT]
    print("\n".join(over) or f"complexity: every function of bitscom/ is at most {LIMIT} (radon)")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
