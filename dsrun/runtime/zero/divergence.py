"""Hang diagnosis for ZeRO stage 3: ranks that run different module sequences.

Stage 3 issues collectives from module hooks, so ranks that take different
branches issue different collectives. On gloo that is worse than a hang: a
broadcast whose sizes differ aborts the receiving process (SIGABRT from a
gloo thread), and equal sizes silently mix up parameters. Every stage-3
collective is therefore announced as an **event** ``(index, step, phase,
name, fingerprint)`` - ``index`` counts the guard's events, ``phase`` is
forward/backward/prefetch/reduce/gather/..., ``name`` the module or
parameters, ``fingerprint`` a 56-bit hash of phase, name and the ids and
sizes of the tensors about to move - and checked, *before* its data moves,
on a **side group**: a gloo backend of the same ranks with a timeout of its
own (CPU tensors even when the data group is NCCL):

* ``check`` (default): one all-reduce MAX of ``[f, -f, i, -i]`` (4 int64);
  a mismatch shows as ``max != min`` on every rank at the same event, so all
  of them raise - before any mismatched data collective is issued;
* ``debug`` (``DSRUN_ZERO_DEBUG=1``): an all-gather of every rank's event
  (counter, hash and names, 512 bytes) instead;
* ``off`` (``DSRUN_ZERO_DEBUG=0``): no check (DeepSpeed's behaviour).

On a mismatch every rank publishes its last ``history`` events in the
default store (``dsrun/zero3/...`` keys), reads the others' and raises
:class:`~dsrun.errors.DsrunError` naming the first collective where the
ranks differ and each rank's module there. When the side group's timeout
(``DSRUN_ZERO_TIMEOUT`` seconds; default 1800, torch's own collective
timeout, so a slow rank fails no sooner than without dsrun) expires - a rank
stopped issuing stage-3 collectives, e.g. it waits in a collective of its
own - the waiting rank sets an alarm key; a daemon **watchdog** thread in
every process polls for it (every 0.5 s) and publishes its rank's history
even while that rank's main thread is blocked, so the report still says
where each rank was.

A side group that failed is marked broken on every rank that took part or
answered the alarm; each of them builds a new one (next store prefix) at
its next event and restarts ``index`` at 0, so the ranks agree again.

The environment is read once, into :class:`GuardSettings`, when a guard is
built.
"""

from __future__ import annotations

import collections
import datetime
import hashlib
import json
import logging
import os
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from dsrun.errors import DsrunConfigError, DsrunError

log = logging.getLogger("dsrun.runtime.zero")

MODES = ("off", "check", "debug")
DEBUG_ENV = "DSRUN_ZERO_DEBUG"
TIMEOUT_ENV = "DSRUN_ZERO_TIMEOUT"
POLL_S = 0.5
HINT = ("under ZeRO stage 3 every rank must run the same modules in the same order "
        "(a data-dependent branch that skips, adds or swaps a module makes the parameter "
        "all-gathers of the ranks differ); a block whose ranks run different parts, such as "
        "an MoE layer routing to different experts, can be made one unit: "
        "deepspeed.utils.set_z3_leaf_modules(model, [BlockClass]) or "
        "zero_optimization.leaf_module")


@dataclass(frozen=True)
class GuardSettings:
    """How stage-3 collectives are checked (module docstring)."""

    mode: str = "check"
    timeout_s: float = 1800.0
    history: int = 32
    grace_s: float = 10.0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise DsrunConfigError(f"ZeRO-3 divergence check mode {self.mode!r}; valid: "
                                   f"{', '.join(MODES)}")
        for name in ("timeout_s", "grace_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise DsrunConfigError(f"GuardSettings.{name} must be > 0, got {value!r}")
        if isinstance(self.history, bool) or not isinstance(self.history, int) \
                or self.history < 1:
            raise DsrunConfigError(f"GuardSettings.history must be >= 1, got {self.history!r}")

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None) -> GuardSettings:
        """``DSRUN_ZERO_DEBUG``: unset/empty = check, 1/true/on/debug = debug,
        0/false/off = off; ``DSRUN_ZERO_TIMEOUT``: seconds (> 0)."""
        env = os.environ if environ is None else environ
        raw = env.get(DEBUG_ENV, "").strip().lower()
        modes = {"": "check", "check": "check", "1": "debug", "true": "debug", "on": "debug",
                 "yes": "debug", "debug": "debug", "0": "off", "false": "off", "off": "off",
                 "no": "off"}
        if raw not in modes:
            raise DsrunConfigError(f"{DEBUG_ENV}={env[DEBUG_ENV]!r}: use 1 (debug), 0 (off) "
                                   "or leave it unset (check)")
        timeout = env.get(TIMEOUT_ENV, "").strip()
        try:
            seconds = float(timeout) if timeout else cls.timeout_s
        except ValueError:
            raise DsrunConfigError(f"{TIMEOUT_ENV}={timeout!r} is not a number of "
                                   "seconds") from None
        return cls(mode=modes[raw], timeout_s=seconds)


# ------------------------------------------------------------------- pure


@dataclass(frozen=True)
class Event:
    """One stage-3 collective as a rank announced it (module docstring)."""

    index: int
    step: int
    phase: str
    name: str
    fingerprint: int

    def describe(self) -> str:
        return f"#{self.index} {self.phase} of {self.name!r} (step {self.step})"


def fingerprint(phase: str, name: str, ids: Sequence[int] = (),
                numels: Sequence[int] = ()) -> int:
    """A 56-bit hash of what an event moves (stable across processes)."""
    text = f"{phase}|{name}|{','.join(map(str, ids))}|{','.join(map(str, numels))}"
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "big")


def first_divergence(histories: Mapping[int, Sequence[Event]]) -> Optional[int]:
    """The smallest event index at which the ranks' histories differ (a
    different fingerprint, or a rank that never got there); None if they
    agree wherever all of them are known."""
    ranks = [r for r, h in histories.items() if h]
    if len(ranks) < 2:
        return None
    by_rank = {r: {e.index: e for e in histories[r]} for r in ranks}
    start = max(min(h) for h in by_rank.values())
    end = max(max(h) for h in by_rank.values())
    for index in range(start, end + 1):
        seen = {by_rank[r][index].fingerprint if index in by_rank[r] else None for r in ranks}
        if len(seen) > 1:
            return index
    return None


def describe_divergence(histories: Mapping[int, Optional[Sequence[Event]]], *, cause: str,
                        world_ranks: Sequence[int]) -> str:
    """The error text: the cause, the first differing collective and what
    each rank ran there, then each rank's recent events."""
    known = {r: list(h) for r, h in histories.items() if h is not None}
    index = first_divergence(known)
    lines = [f"ZeRO stage 3: {cause}."]
    if index is not None:
        parts = []
        for rank in world_ranks:
            events = {e.index: e for e in known.get(rank, [])}
            if rank not in known:
                parts.append(f"rank {rank}: unknown (it did not answer)")
            elif index in events:
                parts.append(f"rank {rank} runs {events[index].phase} of "
                             f"{events[index].name!r}")
            else:
                last = max(events.values(), key=lambda e: e.index, default=None)
                where = f"its last was {last.describe()}" if last else "it issued none"
                parts.append(f"rank {rank} never reached it ({where})")
        lines.append(f"The ranks diverged at ZeRO-3 collective #{index}: " + "; ".join(parts)
                     + ".")
    lines.append(f"Hint: {HINT}.")
    lines.append("Recent ZeRO-3 collectives per rank (oldest first):")
    for rank in world_ranks:
        events = known.get(rank)
        text = ", ".join(f"#{e.index} {e.phase} {e.name!r}" for e in events[-8:]) \
            if events else "(no answer)"
        lines.append(f"  rank {rank}: {text}")
    return "\n".join(lines)


# ------------------------------------------------------------- side groups


class _SideGroup:
    """A gloo backend of its own over ``ranks`` (its own timeout), built
    directly on a unique store prefix: ``new_group`` cannot serve here, as
    with ``use_local_synchronization`` (needed so that non-members need not
    call it) every group of the same ranks gets the same name and store keys.
    ``broken`` once a check failed on it; it is then never used again."""

    def __init__(self, ranks: tuple[int, ...], timeout_s: float, serial: int) -> None:
        prefix = f"dsrun/zero3/side/{'-'.join(map(str, ranks))}/{serial}/"
        store = dist.PrefixStore(prefix, _store())
        self.size = len(ranks)
        self.backend = dist.ProcessGroupGloo(store, ranks.index(dist.get_rank()), self.size,
                                             datetime.timedelta(seconds=timeout_s))
        self.broken = False

    def all_reduce_max(self, tensor: torch.Tensor) -> None:
        self.backend.allreduce(tensor, dist.ReduceOp.MAX).wait()

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(tensor) for _ in range(self.size)]
        self.backend.allgather(out, tensor).wait()
        return out


_side_groups: dict[tuple[tuple[int, ...], float], _SideGroup] = {}
_side_serials: collections.Counter = collections.Counter()
_guard_serials: collections.Counter = collections.Counter()


def _side_group(ranks: tuple[int, ...], timeout_s: float) -> _SideGroup:
    """The live side group for ``ranks`` (shared by guards with the same
    timeout); a new one, with the next serial, when it broke."""
    key = (ranks, timeout_s)
    side = _side_groups.get(key)
    if side is None or side.broken:
        _side_serials[ranks] += 1
        side = _side_groups[key] = _SideGroup(ranks, timeout_s, _side_serials[ranks])
    return side


def group_ranks(group: Any) -> tuple[int, ...]:
    """Global ranks of ``group`` (None: the default group), in group order."""
    if group is None:
        return tuple(range(dist.get_world_size()))
    return tuple(dist.get_process_group_ranks(group))


# -------------------------------------------------------------- the guard


class DivergenceGuard:
    """Checks the stage-3 collectives of one data-parallel group (module
    docstring). :meth:`event` before each collective; ``step`` is kept by
    the owner for messages."""

    def __init__(self, group: Any = None, settings: Optional[GuardSettings] = None) -> None:
        self.settings = settings or GuardSettings.from_env()
        self.group = group
        self.ranks = group_ranks(group)
        self.rank = dist.get_rank()
        self.enabled = len(self.ranks) > 1 and self.settings.mode != "off"
        self.step = 0
        self.index = 0
        self.counts: collections.Counter = collections.Counter()
        self._history: collections.deque[Event] = collections.deque(
            maxlen=self.settings.history)
        self._lock = threading.Lock()
        self._side: Optional[_SideGroup] = None
        _guard_serials[self.ranks] += 1
        self._base = f"dsrun/zero3/{'-'.join(map(str, self.ranks))}/{_guard_serials[self.ranks]}"
        self._generation = 0
        self._answered = -1
        self.closed = False
        if self.enabled:
            _Watchdog.register(self)

    @property
    def namespace(self) -> str:
        return f"{self._base}/g{self._generation}"

    def history(self) -> list[Event]:
        with self._lock:
            return list(self._history)

    def event(self, phase: str, name: str, ids: Sequence[int] = (),
              numels: Sequence[int] = ()) -> None:
        """Announce a collective; raise DsrunError if the ranks disagree."""
        self.counts[phase] += 1
        fresh = self.enabled and (self._side is None or self._side.broken)
        if fresh:
            self._restart()
        record = Event(self.index, self.step, phase, name, fingerprint(phase, name, ids, numels))
        self.index += 1
        with self._lock:
            self._history.append(record)
        if not self.enabled:
            return
        try:
            if fresh:
                self._side = _side_group(self.ranks, self.settings.timeout_s)
            agree = self._exchange(record)
        except RuntimeError as err:  # the side group's timeout, or a peer that failed
            self._fail(f"ZeRO-3 collective {record.describe()} failed on rank {self.rank} "
                       f"({_short(err)}); ranks wait {self.settings.timeout_s:g} s for each "
                       f"other ({TIMEOUT_ENV}; raise it if a rank is legitimately busy that "
                       "long)", err)
        if not agree:
            self._fail(f"the ranks announced different ZeRO-3 collectives at #{record.index} "
                       f"(rank {self.rank}: {record.phase} of {record.name!r})", None)

    def _restart(self) -> None:
        """Before a (new) side group: every rank that gets here restarts
        counting, so ranks agree again after a failure all of them saw."""
        self._generation += 1
        self._answered = -1
        self.index = 0
        with self._lock:
            self._history.clear()

    def _exchange(self, record: Event) -> bool:
        side: _SideGroup = self._side  # type: ignore[assignment]
        if self.settings.mode == "debug":
            others = [_decode(t) for t in side.all_gather(_encode(record))]
            return all((o.index, o.fingerprint) == (record.index, record.fingerprint)
                       for o in others)
        f, i = record.fingerprint, record.index
        values = torch.tensor([f, -f, i, -i], dtype=torch.int64)
        side.all_reduce_max(values)
        return values.tolist() == [f, -f, i, -i]

    def _fail(self, cause: str, err: Optional[BaseException]) -> None:
        """Publish this rank's history, raise the alarm, collect the others'
        and raise the report (the side group is not used again)."""
        if self._side is not None:
            self._side.broken = True
        store = _store()
        histories: dict[int, Optional[list[Event]]] = {self.rank: self.history()}
        self._answered = self._generation  # this rank's watchdog need not answer
        if store is not None:
            try:
                self._publish(store)
                store.set(f"{self.namespace}/alarm", str(self.rank))
                histories.update(self._collect(store))
            except (RuntimeError, ValueError) as exc:  # the store is gone: report what we have
                log.warning("ZeRO-3: could not exchange histories through the store: %s", exc)
        raise DsrunError(describe_divergence(histories, cause=cause,
                                             world_ranks=self.ranks)) from err

    def _publish(self, store: Any) -> None:
        payload = json.dumps([asdict(e) for e in self.history()])
        store.set(f"{self.namespace}/history/{self.rank}", payload)

    def _collect(self, store: Any) -> dict[int, Optional[list[Event]]]:
        keys = {r: f"{self.namespace}/history/{r}" for r in self.ranks if r != self.rank}
        deadline = time.monotonic() + self.settings.grace_s
        out: dict[int, Optional[list[Event]]] = {}
        while keys and time.monotonic() < deadline:
            for rank, key in list(keys.items()):
                if store.check([key]):
                    out[rank] = [Event(**e) for e in json.loads(store.get(key))]
                    del keys[rank]
            if keys:
                time.sleep(0.05)
        out.update({rank: None for rank in keys})
        return out

    def poll_alarm(self, store: Any) -> None:
        """Watchdog side: answer an alarm raised by another rank (once per
        side group): publish this rank's history, mark the side group
        broken so this rank's next event makes a new one."""
        if not self.enabled or self.closed or self._answered == self._generation \
                or self._side is None:
            return
        if not store.check([f"{self.namespace}/alarm"]):
            return
        self._answered = self._generation
        self._side.broken = True  # before publishing: the failing rank waits for the history
        self._publish(store)
        alarm = store.get(f"{self.namespace}/alarm").decode()
        log.error("ZeRO stage 3: rank %s reported diverged or stuck collectives; this rank's "
                  "last ZeRO-3 collectives: %s", alarm,
                  ", ".join(e.describe() for e in self.history()[-8:]) or "none")

    def close(self) -> None:
        self.closed = True
        _Watchdog.unregister(self)


DEBUG_BYTES = 512


def _encode(record: Event) -> torch.Tensor:
    """An event as a fixed-size byte tensor (JSON; the name shortened to fit)."""
    fields = asdict(record)
    fields["name"] = fields["name"][:300]
    raw = json.dumps(fields).encode()[:DEBUG_BYTES]
    out = torch.zeros(DEBUG_BYTES, dtype=torch.uint8)
    out[:len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    return out


def _decode(data: torch.Tensor) -> Event:
    raw = bytes(data.tolist()).rstrip(b"\0")
    return Event(**json.loads(raw.decode()))


def _short(err: BaseException) -> str:
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return text[:200]


def _store() -> Any:
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None


class _Watchdog:
    """One daemon thread per process answering alarms for live guards."""

    _guards: weakref.WeakSet = weakref.WeakSet()
    _thread: Optional[threading.Thread] = None
    _lock = threading.Lock()

    @classmethod
    def register(cls, guard: DivergenceGuard) -> None:
        with cls._lock:
            cls._guards.add(guard)
            if cls._thread is None or not cls._thread.is_alive():
                cls._thread = threading.Thread(target=cls._run, name="dsrun-zero3-watchdog",
                                               daemon=True)
                cls._thread.start()

    @classmethod
    def unregister(cls, guard: DivergenceGuard) -> None:
        with cls._lock:
            cls._guards.discard(guard)

    @classmethod
    def _run(cls) -> None:
        while True:
            time.sleep(POLL_S)
            with cls._lock:
                guards = list(cls._guards)
            if not guards:
                continue
            store = _store()
            if store is None:
                continue
            for guard in guards:
                try:
                    guard.poll_alarm(store)
                except Exception as exc:  # noqa: BLE001 - a watchdog must not die
                    log.debug("ZeRO-3 watchdog: %s", exc)


_shared: dict[tuple[int, ...], DivergenceGuard] = {}


def shared_guard(group: Any = None) -> DivergenceGuard:
    """The process-wide guard of ``group``'s ranks, with the environment's
    settings (used by ``zero.Init`` and ``GatheredParameters``, and by
    stage 3 unless it is given settings of its own)."""
    ranks = group_ranks(group)
    guard = _shared.get(ranks)
    if guard is None or guard.closed:
        guard = _shared[ranks] = DivergenceGuard(group)
    return guard
