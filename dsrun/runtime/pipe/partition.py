"""Which layers each pipeline stage owns (pure, no torch).

A partition of ``L`` layers over ``S`` stages is a tuple of ``S + 1``
boundaries ``0 = b0 < b1 < ... < bS = L``: stage ``s`` owns layers
``[b_s, b_{s+1})``. Every stage owns at least one layer.

``PipelineModule(partition_method=...)`` chooses it:

* ``"parameters"`` (the default): balance the trainable parameter count;
* ``"uniform"``: the same number of layers per stage, the first
  ``L mod S`` stages one more (DeepSpeed's boundaries);
* ``"flops"``: balance each layer's forward + backward floating-point
  operations on a micro-batch shaped like ``example_inputs``, counted on
  torch's meta device (:mod:`~dsrun.runtime.pipe.costs`): balances work, where
  the others balance memory or structure;
* ``"type:REGEX"``: balance the number of layers whose class name matches
  ``REGEX`` (case-insensitive ``re.search``; e.g. ``"type:TransformerBlock"``),
  other layers weigh nothing;
* a sequence of ``S + 1`` integers: these boundaries, checked.

Balancing (:func:`partition_balanced`) minimises the heaviest stage's
weight exactly (binary search on the bottleneck, greedy feasibility); among
the optimal partitions it takes the one that fills earlier stages first.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Optional

from dsrun.errors import DsrunConfigError
from dsrun.runtime.pipe.errors import PipeConfigRuntimeError, PipeNotImplementedError

METHODS = ("parameters", "uniform", "flops", "type:REGEX",
           "explicit boundaries [0, ..., num_layers]")


def _greedy(weights: Sequence[int], parts: int, bottleneck: int) -> tuple[int, ...] | None:
    """Boundaries with every part non-empty and weighing at most
    ``bottleneck``, each part as long as allowed; None if impossible."""
    n = len(weights)
    bounds, i = [0], 0
    for part in range(parts - 1):
        reserve = parts - part - 1  # later parts need one layer each
        if i >= n - reserve:
            return None
        total = weights[i]
        i += 1
        while i < n - reserve and total + weights[i] <= bottleneck:
            total += weights[i]
            i += 1
        if total > bottleneck:
            return None
        bounds.append(i)
    if i >= n or sum(weights[i:]) > bottleneck:
        return None
    bounds.append(n)
    return tuple(bounds)


def partition_balanced(weights: Sequence[int], parts: int) -> tuple[int, ...]:
    """Contiguous non-empty parts minimising the largest part weight."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    if len(weights) < parts:
        raise ValueError(f"{len(weights)} items cannot fill {parts} non-empty parts")
    if any(isinstance(w, bool) or not isinstance(w, int) or w < 0 for w in weights):
        raise ValueError(f"weights must be non-negative integers, got {list(weights)}")
    low, high = max(weights), sum(weights)
    while low < high:  # smallest feasible bottleneck
        mid = (low + high) // 2
        if _greedy(weights, parts, mid) is None:
            low = mid + 1
        else:
            high = mid
    found = _greedy(weights, parts, low)
    assert found is not None  # the total weight is always feasible
    return found


def partition_uniform(num_layers: int, parts: int) -> tuple[int, ...]:
    """``num_layers // parts`` layers per part, one more for each of the first
    ``num_layers % parts`` parts: the boundaries DeepSpeed's ``"uniform"``
    gives, so a layer list is cut where DeepSpeed cuts it."""
    if parts < 1 or num_layers < parts:
        raise ValueError(f"{num_layers} items cannot fill {parts} non-empty parts")
    size, extra = divmod(num_layers, parts)
    return tuple(p * size + min(p, extra) for p in range(parts + 1))


def check_boundaries(bounds: Sequence[object], num_layers: int, stages: int) -> tuple[int, ...]:
    """Explicit boundaries, validated (module docstring)."""
    values = list(bounds)
    where = f"partition_method={values!r}"
    if len(values) != stages + 1:
        raise DsrunConfigError(f"{where}: explicit boundaries need num_stages + 1 = "
                               f"{stages + 1} integers (0, ..., {num_layers}), got {len(values)}")
    if any(isinstance(v, bool) or not isinstance(v, int) for v in values):
        raise DsrunConfigError(f"{where}: boundaries must be integers")
    if values[0] != 0 or values[-1] != num_layers:
        raise DsrunConfigError(f"{where}: boundaries must start at 0 and end at the number "
                               f"of layers, {num_layers}")
    for stage, (a, b) in enumerate(zip(values, values[1:])):
        if b <= a:
            raise DsrunConfigError(f"{where}: stage {stage} would own no layer "
                                   f"(boundaries must increase strictly)")
    return tuple(values)  # type: ignore[arg-type]


def type_matches(pattern: str, names: Sequence[str], where: str = "") -> list[bool]:
    """Whether each layer class name in ``names`` matches the regular
    expression ``pattern`` (case-insensitive search), as ``"type:REGEX"``
    counts them. A bad pattern, or one matching no name, is a
    :class:`DsrunConfigError` (its message prefixed with ``where``); no match
    is also a ``RuntimeError``, as in DeepSpeed."""
    try:
        regex = re.compile(pattern, re.IGNORECASE)
    except re.error as exc:
        raise DsrunConfigError(f"{where}{pattern!r} is not a valid regular expression "
                               f"({exc})") from None
    hits = [regex.search(name) is not None for name in names]
    if not any(hits):
        raise PipeConfigRuntimeError(f"{where}no layer class name matches {pattern!r} "
                                     f"(layers: {', '.join(sorted(set(names)))})")
    return hits


def layer_weights(method: str, names: Sequence[str], param_counts: Sequence[int],
                  flops: Optional[Sequence[int]] = None) -> list[int]:
    """Per-layer weights for a named ``method`` (module docstring);
    ``flops``: each layer's, for ``"flops"``."""
    lowered = method.lower()
    if lowered == "parameters":
        return list(param_counts)
    if lowered == "flops":
        if flops is None or len(flops) != len(names):
            raise ValueError("partition_method='flops' needs one flop count per layer")
        return list(flops)
    if lowered == "uniform":
        return [1] * len(names)
    if lowered.startswith("type:"):
        hits = type_matches(method[len("type:"):], names, f"partition_method={method!r}: ")
        return [1 if hit else 0 for hit in hits]
    if lowered == "profile":
        raise PipeNotImplementedError(
            "partition_method='profile' (timing each layer) is not implemented in dsrun; "
            "'flops' balances each layer's counted work (with example_inputs=), or use "
            "'parameters', 'uniform' or 'type:REGEX'")
    raise PipeNotImplementedError(f"unknown partition_method={method!r}; use one of: "
                                  f"{', '.join(METHODS)}")


def partition_layers(method: object, stages: int, names: Sequence[str],
                     param_counts: Sequence[int],
                     flops: Optional[Sequence[int]] = None) -> tuple[int, ...]:
    """The boundaries ``method`` gives for these layers on ``stages`` stages."""
    num_layers = len(names)
    if len(param_counts) != num_layers:
        raise ValueError("names and param_counts must have equal lengths")
    if num_layers < stages:
        raise DsrunConfigError(f"{num_layers} layer(s) cannot fill {stages} pipeline stages: "
                               "every stage needs at least one layer")
    if isinstance(method, str) and method.lower() == "uniform":
        return partition_uniform(num_layers, stages)
    if isinstance(method, str):
        return partition_balanced(layer_weights(method, names, param_counts, flops), stages)
    if isinstance(method, Sequence):
        return check_boundaries(method, num_layers, stages)
    raise DsrunConfigError(f"partition_method must be a string or a sequence of boundaries, "
                           f"got {type(method).__name__}")
