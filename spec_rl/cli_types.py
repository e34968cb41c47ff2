"""Value types of the ``spec-rl`` flags: each parses a flag's text or raises ``argparse.ArgumentTypeError``."""

from __future__ import annotations

import argparse


def checked(parse, ok, requirement: str):
    """An argparse ``type``: ``parse(text)`` that passes ``ok``, else "must be <requirement>, got <text>"."""

    def convert(text: str):
        try:
            value = parse(text)
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError(f"must be {requirement}, got {text!r}")
        return value

    return convert


fraction = checked(float, lambda v: 0.0 < v < 1.0, "a number in (0, 1)")
positive_int = checked(int, lambda v: v >= 1, "an integer >= 1")
