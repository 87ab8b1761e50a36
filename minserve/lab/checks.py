"""What a check cell is made of: :func:`require`, a chapter's claim that fails by asserting.

Every ``*_checks`` module states its chapter's claims with it, so a failed check reads the same everywhere:
an ``AssertionError`` whose message names the claim and the numbers that broke it.
"""

from __future__ import annotations


def require(condition: bool, message: str) -> None:
    """``assert`` that survives ``python -O``: the checks are the chapter's claims, never optimised away."""
    if not condition:
        raise AssertionError(message)
