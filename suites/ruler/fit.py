"""Fitting a prompt to a token length: find the fill (haystack words, list entries, ...) whose full prompt,
counted with the target's tokenizer, lands in [target − tol, target].

``count(n)`` is the exact prompt length at fill n (one tokenization); it grows with n, nearly monotonically.
The search keeps a bracket a < b with count(a) <= target < count(b), guesses inside it by linear
interpolation (secant steps from the lower end while no upper end is known), and falls back to bisection
when interpolation stalls.  A starting guess (the haystack's token index estimate) usually makes it two or
three tokenizations.  The result depends only on ``count`` and the arguments (never on earlier searches),
so the same item gets the same fill in every cell.
"""

from __future__ import annotations

from typing import Callable, Optional

from kvbench.suites.base import SuiteError


class BelowMinimum(SuiteError):
    """The prompt at the smallest fill is already longer than the target."""

    def __init__(self, minimum: int, target: int):
        super().__init__(f"{minimum} > {target}")
        self.minimum = minimum


class TooShort(SuiteError):
    """Even the largest fill stays below the target (a haystack file too short)."""

    def __init__(self, reached: int, target: int):
        super().__init__(f"{reached} < {target}")
        self.reached = reached


def fit_length(count: Callable[[int], int], target: int, lo: int, hi: Optional[int], tol: int,
               guess: Optional[int] = None, per_unit: float = 1.0) -> tuple[int, int]:
    """(fill, prompt tokens) with target − tol <= tokens <= target.  Raises BelowMinimum, TooShort, or
    SuiteError when the count jumps over the window (fill units coarser than ``tol`` tokens)."""
    a, ca = lo, count(lo)
    if ca > target:
        raise BelowMinimum(ca, target)
    c_lo = ca
    b: Optional[int] = None
    cb = 0
    n = guess if guess is not None and guess > lo else lo + max(1, int((target - ca) / max(per_unit, 1e-6)))
    last_side = None
    for _ in range(64):
        if ca >= target - tol:
            return a, ca
        top = (b - 1) if b is not None else (hi if hi is not None else None)
        if top is not None and top <= a:
            break
        n = max(n, a + 1)
        if top is not None:
            n = min(n, top)
        c = count(n)
        side = "low" if c <= target else "high"
        if side == "low":
            a, ca = n, c
        else:
            b, cb = n, c
        if b is None:  # secant from the lower end (or the first guess's slope)
            slope = (ca - c_lo) / (a - lo) if a > lo and ca > c_lo else per_unit
            n = a + max(1, int((target - ca) / max(slope, 1e-6)))
        elif side == last_side and b - a > 4:  # interpolation keeps landing on one side: bisect
            n = (a + b) // 2
        else:
            n = a + max(1, int((target - ca) * (b - a) / max(cb - ca, 1)))
        last_side = side
    if ca >= target - tol:
        return a, ca
    if b is None and hi is not None and a >= hi:
        raise TooShort(ca, target)
    # the count jumps over the window between neighbours: fills are not exactly monotone, so look around
    for n in [a + d for d in range(2, 10)] + [a - d for d in range(1, 9)]:
        if n >= lo and (hi is None or n <= hi) and target - tol <= count(n) <= target:
            return n, count(n)
    raise SuiteError(f"cannot fit a prompt of {target} tokens within {tol}: fill {a} gives {ca} tokens, fill "
                     f"{a + 1} gives {cb if b == a + 1 else 'more than ' + str(target)}")
