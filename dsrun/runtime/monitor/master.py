"""``engine.monitor``: DeepSpeed's ``MonitorMaster`` - one ``write_events``
that rank 0 fans out to every enabled writer.

Invariants:

* ``enabled`` is the same on every rank (it comes from the config); only
  rank 0 holds writers, so ``write_events`` is a no-op elsewhere and
  scripts may call it on every rank, as with DeepSpeed.
* Events are checked before any writer sees them: a malformed event is the
  script's bug and raises :class:`DsrunError` naming it.
* A writer that fails once training runs (disk full, a lost mount, a wandb
  error) is warned about once, closed and dropped; the other writers and
  training go on.
* A monitor with writers is closed at exit unless closed before
  (``engine.destroy()`` closes the engine's); the exit hook holds it only
  weakly, so a closed or dropped monitor, and its writers, are freed.
"""

from __future__ import annotations

import atexit
import logging
import math
import numbers
import weakref
from collections.abc import Iterable, Sequence
from typing import Any, Callable, Optional

from dsrun.errors import DsrunError
from dsrun.runtime.config_monitors import MONITOR_SECTIONS
from dsrun.runtime.monitor.events import Event
from dsrun.runtime.monitor.writers import Writer, build_writers, check_packages

log = logging.getLogger("dsrun.runtime.monitor")

# The monitors with writers not yet closed; one exit hook for all of them
# (a bound method per monitor in atexit would keep each one alive to the end).
_open_monitors: weakref.WeakSet[Monitor] = weakref.WeakSet()


def _close_at_exit() -> None:
    for monitor in list(_open_monitors):
        monitor.close()


def _close_at_exit_later(monitor: Monitor) -> None:
    _open_monitors.add(monitor)
    # registered once, moved last: it runs before the hooks registered
    # earlier (the process group's shutdown), as one per monitor did
    atexit.unregister(_close_at_exit)
    atexit.register(_close_at_exit)


def _as_number(value: Any) -> Optional[float]:
    if isinstance(value, numbers.Real):  # bools too: 0 or 1, as TensorBoard takes them
        return float(value)
    if hasattr(value, "numel") and hasattr(value, "item"):  # a one-element tensor
        return float(value.item()) if value.numel() == 1 else None
    return None


def _as_step(step: Any) -> Optional[int]:
    if isinstance(step, bool):
        return None
    if isinstance(step, numbers.Integral):
        return int(step)
    if isinstance(step, numbers.Real) and math.isfinite(step) and float(step).is_integer():
        return int(step)  # 5.0: DeepSpeed's writers take it (a step computed in floats)
    if hasattr(step, "numel") and hasattr(step, "item") and step.numel() == 1:
        item = step.item()  # a one-element tensor (engine.global_samples kept as one)
        if isinstance(item, float) and math.isfinite(item) and item.is_integer():
            return int(item)  # a whole float, as a float step
        return int(item) if isinstance(item, int) and not isinstance(item, bool) else None
    return None


def check_events(events: Iterable[Any]) -> list[Event]:
    """``events`` as ``(str, float, int)`` tuples, or an error naming the bad one."""
    checked = []
    for index, event in enumerate(events):
        ok = isinstance(event, (tuple, list)) and len(event) == 3
        name, value, step = event if ok else (None, None, None)
        number, at = _as_number(value), _as_step(step)
        if not (ok and isinstance(name, str) and name and number is not None
                and at is not None):
            raise DsrunError(f"monitor.write_events: event {index} is {event!r}; each event "
                             "must be (name: str, value: number, bool or one-element tensor, "
                             "step: int, whole float or one-element integer tensor)")
        checked.append((name, number, at))
    return checked


class Monitor:
    """Fan-out to the writers of the enabled sections (module docstring)."""

    def __init__(self, config: Any, rank: int,
                 build: Callable[[Any], list[Writer]] = build_writers) -> None:
        self.enabled = any(getattr(config, s).enabled for s in MONITOR_SECTIONS)
        self.rank = rank
        self.writers: list[Writer] = []
        if not self.enabled:
            return
        check_packages(config)  # every rank fails alike on a missing package
        if rank == 0:
            self.writers = build(config)
            _close_at_exit_later(self)
            log.info("monitors: %s", ", ".join(_describe(w) for w in self.writers))

    def write_events(self, events: Sequence[Any]) -> None:
        """Write ``[(name, value, step), ...]`` to every writer (rank 0).
        With a monitor enabled every rank checks the events, so a bad one is
        the same error on every rank; without one they are ignored."""
        if not self.enabled:
            return
        checked = check_events(events)
        if not self.writers:
            return
        for writer in list(self.writers):
            try:
                writer.write(checked)
            except Exception as err:  # noqa: BLE001 - a monitor must never stop training
                self._drop(writer, err)

    def _drop(self, writer: Writer, err: BaseException) -> None:
        self.writers.remove(writer)
        log.warning("%s: writing metrics failed (%s: %s); %s is off for the rest of this "
                    "run, training goes on", writer.name, type(err).__name__, err, writer.name)
        try:
            writer.close()
        except Exception:  # noqa: BLE001 - already reported; closing is best effort
            pass

    def close(self) -> None:
        """Close every writer (idempotent; also runs at exit)."""
        writers, self.writers = self.writers, []
        _open_monitors.discard(self)
        for writer in writers:
            try:
                writer.close()
            except Exception as err:  # noqa: BLE001
                log.warning("%s: closing failed: %s", writer.name, err)


def _describe(writer: Writer) -> str:
    where = getattr(writer, "log_dir", None)
    return f"{writer.name} -> {where}" if where else writer.name


def finite(value: Optional[float]) -> bool:
    return value is not None and math.isfinite(value)
