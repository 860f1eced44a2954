"""Do a bench's runners train the same thing? Their per-step losses compared.

The runners of ``train_throughput.py``, ``pipeline.py`` and ``checkpoint.py``
start from the same weights and see the same data, so each step's loss must
agree across runners up to the order of floating-point reductions. A runner
that silently trained something else, or nothing, would still produce a
timing table; this check makes the bench say so and exit non-zero.

The reference is the entry that agrees with the most others (the largest
agreeing group), not the first one given, so that a broken first runner is
the one named; with no majority (two entries, or groups of equal size) the
lines say that either side may be the odd one.

The tolerance (:data:`RTOL`, relative) is far below what one optimizer step
moves the loss on the bench models (16-35 % per step with their repeated
batch at lr 3e-4: 339.2, 284.0, 207.6, 135.7 on the small model) and far
above the fp32 reduction-order differences seen between runners (identical to
6 decimals over a few steps). Telling "trains nothing" apart needs at least
two recorded steps: the first loss is computed before any update. So
:func:`check` also names a runner whose recorded losses never move from
the first (every runner agreeing on a loss that does not change is no
evidence of training), and says so when a runner recorded fewer than two
steps, where neither can be told.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

RTOL = 1e-4  # relative, per step
ATOL = 1e-6  # absolute floor, for losses near zero


def _difference(name: str, mine: Sequence[float], ref_name: str, ref: Sequence[float],
                rtol: float, atol: float) -> str | None:
    """How ``mine`` differs from ``ref`` (their step counts, or the first
    step that differs and both values), or None when they agree."""
    if len(mine) != len(ref):
        return f"{name}: {len(mine)} losses, {ref_name}: {len(ref)}"
    for step, (a, b) in enumerate(zip(mine, ref)):
        if not math.isclose(a, b, rel_tol=rtol, abs_tol=atol):
            return f"{name} step {step}: loss {a!r}, {ref_name}: {b!r}"
    return None


def reference(losses: dict[str, Sequence[float]], rtol: float = RTOL,
              atol: float = ATOL) -> tuple[str, bool]:
    """(the entry that agrees with the most others - the first such on a
    tie, whether its group is a strict majority of ``losses``)."""
    names = list(losses)
    agree = {n: sum(_difference(n, losses[n], m, losses[m], rtol, atol) is None
                    for m in names if m != n) for n in names}
    best = max(names, key=lambda n: agree[n])
    return best, 2 * (agree[best] + 1) > len(names)


def mismatches(losses: dict[str, Sequence[float]], rtol: float = RTOL,
               atol: float = ATOL) -> list[str]:
    """Each entry of ``losses`` (a name -> its losses, step by step) that
    differs from the reference's (:func:`reference`): one line per such
    entry naming both, the first step that differs and both values. A
    different number of steps, or a NaN, is a difference."""
    if not losses:
        return []
    ref_name, majority = reference(losses, rtol, atol)
    unsure = "" if majority or len(losses) <= 2 else \
        f" (no majority agrees: {ref_name} may be the odd one)"
    found = []
    for name, values in losses.items():
        how = None if name == ref_name else \
            _difference(name, values, ref_name, losses[ref_name], rtol, atol)
        if how is not None:
            found.append(how + unsure)
    return found


def stalled(losses: dict[str, Sequence[float]], rtol: float = RTOL,
            atol: float = ATOL) -> list[str]:
    """One line per entry of ``losses`` with at least two values that all
    equal its first within the tolerance: it trained nothing (an update at
    the benches' learning rate moves the loss by percents per step)."""
    return [f"{name}: the loss never changed over {len(values)} steps ({values[0]!r}): "
            "nothing was trained"
            for name, values in losses.items()
            if len(values) >= 2 and all(math.isclose(v, values[0], rel_tol=rtol, abs_tol=atol)
                                        for v in values[1:])]


def check(losses: dict[str, Sequence[float]], what: str = "losses",
          rtol: float = RTOL) -> list[str]:
    """Print whether ``losses`` agree (the tolerance and the reference's
    values) and return the mismatches (:func:`mismatches`) and the runners
    that trained nothing (:func:`stalled`); the caller exits non-zero on
    any."""
    found = mismatches(losses, rtol) + stalled(losses, rtol)
    if not losses:
        return found
    short = [name for name, values in losses.items() if len(values) < 2]
    if short:
        print(f"{what}: {', '.join(short)} recorded fewer than two steps, so whether "
              "they trained at all cannot be told (run more steps)")
    ref_name = reference(losses, rtol)[0]
    shown = ", ".join(f"{v:.6f}" for v in losses[ref_name])
    verdict = "MISMATCH" if found else "all agree"
    print(f"{what}: {verdict} (relative tolerance {rtol:g}; {len(losses)} compared with "
          f"{ref_name}, the one most agree with: {shown})")
    for line in found:
        print(f"  {line}")
    return found


def exit_on(found: list[str], what: str = "losses") -> None:
    """Exit non-zero naming the runners whose ``what`` differed."""
    if found:
        raise SystemExit(f"{what} differ between runners: " + "; ".join(found))
