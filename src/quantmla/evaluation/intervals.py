"""95 % intervals for retrieval accuracy: one method's accuracy, and its difference to BF16 on the same samples.

Retrieval is a proportion of n samples answered exactly. Every method of a model reads the same samples,
so a method's difference to BF16 is a difference of paired proportions: what decides it is the discordant
samples (one right, the other wrong), not the two accuracies alone.

- ``wilson(k, n)``: Wilson's score interval of k successes in n trials (Wilson 1927). Unlike k/n ± 1.96·se it
  stays inside [0, 1] and keeps a width at 0 and n successes.
- ``paired_difference(x, y)``: Newcombe's hybrid score interval for p_x - p_y on paired samples (method 10 of
  Newcombe 1998, Statistics in Medicine 17:2635), built from both Wilson intervals and the phi correlation of
  the pairs.

All values are fractions in [0, 1] (differences in [-1, 1]); the table prints them in points.
"""

from __future__ import annotations

import math

Z95 = 1.959963984540054  # the standard normal's 97.5 % quantile


def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval (lo, hi) of the proportion k / n; (0, 1) when n is 0."""
    if n <= 0:
        return 0.0, 1.0
    if not 0 <= k <= n:
        raise ValueError(f"wilson: {k} successes out of {n} trials")
    p = k / n
    den = 1.0 + z * z / n
    centre = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return max(0.0, centre - half), min(1.0, centre + half)


def paired_difference(x: list[bool], y: list[bool], z: float = Z95) -> tuple[float, float, float]:
    """(difference, lo, hi) of p_x - p_y where x[i] and y[i] are the outcomes of one sample under two methods.

    Newcombe's method 10: the Wilson intervals of both proportions, combined with the phi coefficient of the
    2x2 table of pairs (phi is 0 where a margin is empty)."""
    if len(x) != len(y):
        raise ValueError(f"paired_difference: {len(x)} and {len(y)} outcomes; pairs need the same samples")
    n = len(x)
    if n == 0:
        return 0.0, -1.0, 1.0
    a = sum(1 for u, v in zip(x, y) if u and v)
    b = sum(1 for u, v in zip(x, y) if u and not v)
    c = sum(1 for u, v in zip(x, y) if v and not u)
    d = n - a - b - c
    p1, p2 = (a + b) / n, (a + c) / n
    l1, u1 = wilson(a + b, n, z)
    l2, u2 = wilson(a + c, n, z)
    den = (a + b) * (c + d) * (a + c) * (b + d)
    phi = (a * d - b * c) / math.sqrt(den) if den > 0 else 0.0
    delta = p1 - p2
    lo = delta - math.sqrt(max(0.0, (p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2))
    hi = delta + math.sqrt(max(0.0, (u1 - p1) ** 2 - 2 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2) ** 2))
    return delta, max(-1.0, lo), min(1.0, hi)
