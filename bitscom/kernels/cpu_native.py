"""Placeholder until the native CPU loop lands."""


def available() -> bool:
    return False
