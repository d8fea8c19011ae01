"""Placeholder until the CuPy path lands."""


def available() -> bool:
    return False
