"""Do a bench's runners train the same thing? Their per-step losses compared.

The runners of ``train_throughput.py``, ``pipeline.py`` and ``checkpoint.py``
start from the same weights and see the same data, so each step's loss must
agree across runners up to the order of floating-point reductions. A runner
that silently trained something else, or nothing, would still produce a
timing table; this check makes the bench say so and exit non-zero.

The tolerance (:data:`RTOL`, relative) is far below what one optimizer step
moves the loss on the bench models (about 1 % per step at lr 3e-4) and far
above the fp32 reduction-order differences seen between runners (identical to
6 decimals over a few steps).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

RTOL = 1e-4  # relative, per step
ATOL = 1e-6  # absolute floor, for losses near zero


def mismatches(losses: dict[str, Sequence[float]], rtol: float = RTOL,
               atol: float = ATOL) -> list[str]:
    """Each entry of ``losses`` (a name -> its losses, step by step) that
    differs from the first entry's: one line per such entry naming both, the
    first step that differs and both values. A different number of steps, or
    a NaN, is a difference."""
    if not losses:
        return []
    (ref_name, ref), *rest = losses.items()
    found = []
    for name, values in rest:
        if len(values) != len(ref):
            found.append(f"{name}: {len(values)} losses, {ref_name}: {len(ref)}")
            continue
        for step, (mine, theirs) in enumerate(zip(values, ref)):
            if not math.isclose(mine, theirs, rel_tol=rtol, abs_tol=atol):
                found.append(f"{name} step {step}: loss {mine!r}, {ref_name}: {theirs!r}")
                break
    return found


def check(losses: dict[str, Sequence[float]], what: str = "losses",
          rtol: float = RTOL) -> list[str]:
    """Print whether ``losses`` agree (the tolerance and the reference's
    values) and return the mismatches (:func:`mismatches`); the caller exits
    non-zero on any."""
    found = mismatches(losses, rtol)
    if not losses:
        return found
    ref_name, ref = next(iter(losses.items()))
    shown = ", ".join(f"{v:.6f}" for v in ref)
    verdict = "MISMATCH" if found else "all agree"
    print(f"{what}: {verdict} (relative tolerance {rtol:g}; {len(losses)} compared with "
          f"{ref_name}: {shown})")
    for line in found:
        print(f"  {line}")
    return found


def exit_on(found: list[str], what: str = "losses") -> None:
    """Exit non-zero naming the runners whose ``what`` differed."""
    if found:
        raise SystemExit(f"{what} differ between runners: " + "; ".join(found))
