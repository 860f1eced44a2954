"""How the ranks of a save or load agree, with a deadline and named ranks.

:meth:`Coordinator.agree` is the first step of every save and load: each
rank posts what it was asked (the tag, ...) under a per-call key in the
process group's store and waits, at most ``timeout_s``, for every other
rank's. A rank that never arrives - ``save_checkpoint`` called on rank 0
only - is named in the error instead of hanging the job; ranks that were
asked different things (different tags) get one error naming which rank
asked what. Keys are numbered by call, so every rank must make its
checkpoint calls in the same order (as DeepSpeed requires); after a
timeout the numbering cannot be trusted and every later call fails at once.
Each rank also counts itself in on one counter key of the call
(:data:`ARRIVED`, ``store.add``), and the wait polls that one key
(:data:`AGREE_POLL_S` backing off to :data:`AGREE_POLL_MAX_S`, so a save
whose ranks arrive at different times starts at most that much after the
last one): a poll costs rank 0's store one lookup whatever the world size
(polling every rank's key cost ``world`` lookups per rank per poll, about
20 million a second at 1024 ranks); the payloads are read once, with one
``multi_get``, and the per-rank keys are looked at one by one only to name
the missing ranks (a timeout, an exit). The wait also looks, every
:data:`EXIT_POLL_S`, for ranks that have exited (runtime/exitmark.py): a
rank that left before the call, or during it, fails the others within
about a second (after :data:`EXIT_GRACE_S`) with an error naming it and
its exit status, not ``checkpoint.timeout`` later; so does rank 0
leaving (its store's calls then fail). An exchange that fails names a
rank that exited the same way ("rank 1 exited (status 0) during the
save").

:meth:`Coordinator.exchange` (an all-gather of small Python objects) is
how ranks learn each other's results after the agreement: it runs on a
gloo group of its own (created on first use, after an agreement, so all
ranks are there), never on the training group, whatever the training
backend.

:class:`SaveBoard` is how the background threads of an asynchronous save
tell each other how it went, in the same store under the number of the
save's agreement (``dsrun/checkpoint/CALL/save/``: a later save's keys
cannot be taken for this one's). It needs no disk space (a full disk is
the usual failure) and no collective (the thread must not run one:
:mod:`.async_save`); the store's client serialises calls from several
threads, so a thread polls (backing off from :data:`KEY_POLL_S` to
:data:`KEY_POLL_MAX_S`) rather than block the client in ``store.wait``.
The keys, and who posts them:

* ``R`` and ``count`` - rank R's thread, when its part failed or stopped
  for another rank's failure (rank 0's also when it gave up on a silent
  rank): its error (``count`` says how many were posted, so rank 0's
  committer, polling, reads nothing more while it is 0);
* ``outcome`` - rank 0's thread, once it is done with ``TAG.tmp/``
  (committed, or removed after a failure): its verdict, which every other
  rank's thread waits for and takes as its own;
* ``reported`` and ``reported/all`` - each rank that has the save's error,
  once it has reported it (printed it at exit, or handed it to the script
  to raise): ``reported`` counts them, the last of all ``world`` sets
  ``reported/all``, for which a rank that exits with the error waits
  (:func:`~.async_save._wait_at_exit`).

Rank 0 deletes them (:meth:`SaveBoard.clear`) when it starts its next
asynchronous save: every rank agreed on that one, so every rank's thread of
this save has ended, and no rank exits with its error any more.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import json
import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple, NoReturn, Optional

import torch.distributed as dist

from dsrun import comm as collectives
from dsrun.errors import RANK_LOST, CheckpointError
from dsrun.runtime import exitmark
from dsrun.runtime.exitmark import STORE_GONE, ExitWatch, describe_exit, store_reachable

log = logging.getLogger("dsrun.runtime.checkpoint")

EXCHANGE_TIMEOUT_S = 3600.0  # once all ranks are in, writing may take long
KEY_POLL_S = 0.05  # a background thread polls: a blocking store.wait would hold the client
KEY_POLL_MAX_S = 1.0  # ... backing off to this: every rank polls rank 0's store
AGREE_POLL_S = 0.01  # an agreement polls for the keys (a timed-out store.wait logs) ...
AGREE_POLL_MAX_S = 0.05  # ... backing off to this: the last rank's key is seen this soon
EXIT_POLL_S = 0.5  # how often it also looks for ranks that exited (two more store calls)
# Having seen a rank that exited, an agreement waits this long before it
# raises: the exiting rank's process has ended by then and its agent has
# told the launcher, whose report then names that exit as the cause.
EXIT_GRACE_S = 1.0
# a SaveBoard's keys (module docstring)
COUNT, OUTCOME, REPORTED, ALL_REPORTED = "count", "outcome", "reported", "reported/all"
#: an agreement's counter key (``dsrun/checkpoint/CALL/arrived``): how many ranks posted
ARRIVED = "arrived"
_calls = itertools.count()  # process-wide: all engines of a process share the numbering


def post_arrival(store: Any, prefix: str, rank: int, payload: Any) -> None:
    """Post ``rank``'s ``payload`` for the agreement under ``prefix``, then
    count it in: the key is set before the count, so a count that reaches
    the world size means every key can be read."""
    store.set(prefix + str(rank), json.dumps(payload))
    store.add(prefix + ARRIVED, 1)


def _get_all(store: Any, keys: list[str]) -> list[Any]:
    """The values of ``keys``, in one store call where the store has
    ``multi_get`` (torch >= 2.5)."""
    if hasattr(store, "multi_get"):
        try:
            return list(store.multi_get(keys))
        except NotImplementedError:  # a store class that leaves it out: one by one
            pass
    return [store.get(k) for k in keys]


def describe_ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


class Coordinator:
    """Agreement and exchange among all ranks of the default group."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = float(timeout_s)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self._group: Any = None
        self._broken: Optional[str] = None
        self._last_call: Optional[int] = None
        self._what = ""  # the call last agreed on (an exchange's error names it)

    def _store(self) -> Any:
        try:
            return dist.distributed_c10d._get_default_store()
        except (AttributeError, RuntimeError, ValueError):
            return None

    def agree(self, what: str, payload: dict[str, Any]) -> list[dict[str, Any]]:
        """Every rank's ``payload`` for this call, in rank order (module docstring)."""
        if self._broken:
            raise CheckpointError(f"{what} refused: {self._broken}")
        call = self._last_call = next(_calls)
        if self.world == 1:
            return [payload]
        store = self._store()
        if store is None:  # no store to name the missing ranks with
            return self.exchange(payload)
        prefix = f"dsrun/checkpoint/{call}/"
        self._what = what
        try:
            self._check_reachable(store)
            post_arrival(store, prefix, self.rank, payload)
        except Exception as exc:  # noqa: BLE001 - torch's store errors vary by version
            self._store_gone(what, exc)
        keys = [prefix + str(r) for r in range(self.world)]
        self._wait_all(store, prefix, what)
        out = [json.loads(value) for value in _get_all(store, keys)]
        if call >= 2:  # every rank has read call-2's keys once it posted call-1's
            old = [f"dsrun/checkpoint/{call - 2}/{self.rank}"]
            if self.rank == 0:  # every rank is past call-2's wait: it posted call's key
                old.append(f"dsrun/checkpoint/{call - 2}/{ARRIVED}")
            for key in old:
                try:
                    store.delete_key(key)
                except Exception:  # noqa: BLE001 - a store without deletion only keeps them
                    pass
        return out

    def _wait_all(self, store: Any, prefix: str, what: str) -> None:
        """Wait until every rank has posted its key under ``prefix`` (its
        :data:`ARRIVED` counter reaches the world size), polling that one
        key (a timed-out ``store.wait`` logs warnings), every
        :data:`AGREE_POLL_S` at first, then less and less often, up to
        :data:`AGREE_POLL_MAX_S`; every :data:`EXIT_POLL_S`, a rank that
        exited (exitmark.py) or rank 0's store gone ends the wait with an
        error naming that rank. The missing ranks are named from their
        keys: when every key is there (a rank died between its key and its
        count), an exit seen or the deadline ends the wait as a success."""
        keys = [prefix + str(r) for r in range(self.world)]
        deadline = time.monotonic() + self.timeout_s
        watch, gone = ExitWatch(exitmark.job_store() or store, self.world), 0
        pause, next_exit_poll = AGREE_POLL_S, 0.0
        while True:
            try:
                if int(store.add(prefix + ARRIVED, 0)) >= self.world:
                    return
                if time.monotonic() < next_exit_poll:
                    exited = watch.exited
                else:  # the exit count costs a store call: less often than the keys
                    next_exit_poll = time.monotonic() + EXIT_POLL_S
                    self._check_reachable(store)
                    exited = watch.poll()
                if len(exited) > gone:  # a rank that posted before exiting is not missing
                    gone = len(exited)
                    missing = self._missing(store, keys)
                    if not missing:  # every key is there: one rank left before its add
                        return
                    if any(r in exited for r in missing):
                        time.sleep(EXIT_GRACE_S)
                    self._exited_before(what, missing, exited)
            except CheckpointError:
                raise
            except Exception as exc:  # noqa: BLE001 - torch's store errors vary by version
                self._store_gone(what, exc)
            left = deadline - time.monotonic()
            if left <= 0:
                missing = self._missing(store, keys)
                if not missing:  # the last key came after the last poll, or without its add
                    return
                self._timed_out(missing, what)
            time.sleep(min(pause, left))
            pause = min(pause * 2, AGREE_POLL_MAX_S)

    def _exited_before(self, what: str, missing: list[int],
                       exited: dict[int, dict[str, Any]]) -> None:
        """Raise when a rank this call still waits for has exited."""
        left = [r for r in missing if r in exited]
        if not left:
            return
        causes = "; ".join(
            describe_exit(r, exited[r]) + (f" during its {what}, before every rank had "
                                           "reached it" if exited[r].get("during") == what
                                           else f" before calling {what}") for r in left)
        present = [r for r in range(self.world) if r not in missing]
        self._broken = f"{causes}; restart the job"
        raise CheckpointError(f"{what} failed on {describe_ranks(present)}: {causes} (every "
                              f"rank must call it; {RANK_LOST} while the others waited for "
                              "it). Nothing was written; the previous checkpoint and 'latest' "
                              "are intact")

    @staticmethod
    def _check_reachable(store: Any) -> None:
        """Raise (for :meth:`_store_gone`) when rank 0's store refuses a plain
        connection: a store call would fail too, after torch printed a C++
        stack trace (exitmark.store_reachable)."""
        if not store_reachable(store):
            raise ConnectionRefusedError("the store's port refuses connections")

    def _store_gone(self, what: str, exc: Exception) -> NoReturn:
        time.sleep(EXIT_GRACE_S)  # as for an exit seen (EXIT_GRACE_S)
        self._broken = f"{STORE_GONE} during an earlier {what}; restart the job"
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]  # no C++ frames
        raise CheckpointError(f"{what} failed: {STORE_GONE} ({reason}; {RANK_LOST} while the "
                              "others waited for it): nothing was written; the previous "
                              "checkpoint and 'latest' are intact") from None

    def _missing(self, store: Any, keys: list[str]) -> list[int]:
        """The ranks whose key is not posted. The counter can be short of
        them: a rank killed between its ``set`` and its ``add`` (its key is
        readable, its exit mark tells the next exchange)."""
        return [r for r in range(self.world) if not store.check([keys[r]])]

    def _timed_out(self, missing: list[int], what: str) -> NoReturn:
        present = [r for r in range(self.world) if r not in missing]
        self._broken = (f"an earlier {what} timed out waiting for "
                        f"{describe_ranks(missing)}; restart the job")
        raise CheckpointError(
            f"{what} was called on {describe_ranks(present)} but {describe_ranks(missing)} "
            f"did not call it within {self.timeout_s:g} s (checkpoint.timeout): every rank "
            "must call it, with the same arguments")

    def board(self) -> Optional[SaveBoard]:
        """The :class:`SaveBoard` of the save just agreed on; None at world
        size 1 or without a store (the ranks then fall back to error files)."""
        store = self._store() if self.world > 1 and self._last_call is not None else None
        if store is None:
            return None
        return SaveBoard(store, f"dsrun/checkpoint/{self._last_call}/save/", self.world)

    def exchange(self, obj: Any) -> list[Any]:
        """``obj`` of every rank, in rank order (an all-gather on the
        checkpoint group; world size 1: no communication)."""
        if self.world == 1:
            return [obj]
        if self._group is None:
            self._group = dist.new_group(
                backend="gloo",
                timeout=datetime.timedelta(seconds=max(self.timeout_s, EXCHANGE_TIMEOUT_S)))
        out: list[Any] = [None] * self.world
        try:
            collectives.all_gather_object(out, obj, group=self._group)
        except RuntimeError as exc:
            self._broken = f"a checkpoint exchange between ranks failed ({exc})"
            time.sleep(EXIT_GRACE_S)  # its mark is set; its agent reports it (EXIT_GRACE_S)
            exited = self._exited_now()
            if exited:
                self._broken = f"{exited} during an earlier {self._what}; restart the job"
                phase = "the load" if "load" in self._what else "the save"
                raise CheckpointError(f"{self._what} failed: {exited} during {phase} "
                                      f"({RANK_LOST}; the exchange between ranks failed: "
                                      f"{exc})") from None
            raise CheckpointError(f"ranks could not exchange checkpoint status: {exc} "
                                  f"({RANK_LOST} during the save or load)") from None
        return out

    def _exited_now(self) -> str:
        """The ranks that exited (exitmark.py), described, after a failed
        exchange; rank 0 when its store is gone; "" when none is known."""
        store = exitmark.job_store() or self._store()
        if store is None:
            return ""
        try:
            exited = ExitWatch(store, self.world).poll()
        except Exception:  # noqa: BLE001 - torch's store errors vary by version
            return STORE_GONE
        return "; ".join(describe_exit(r, exited[r]) for r in sorted(exited))


class Failure(NamedTuple):
    """A rank's failed part of a save; ``cause`` False: it stopped because
    another rank failed (``message`` is then that rank's)."""

    rank: int
    message: str
    cause: bool = True


def first_failure(failures: Iterable[Optional[Failure]]) -> Optional[Failure]:
    """The one to report: the lowest rank that failed first-hand, else the
    lowest that stopped because of another; None when there is none."""
    return min((f for f in failures if f is not None), key=lambda f: (not f.cause, f.rank),
               default=None)


class SaveBoard:
    """Failures of one asynchronous save, in the c10d store (module docstring)."""

    def __init__(self, store: Any, prefix: str, world: int) -> None:
        self.store, self.prefix, self.world = store, prefix, world
        self._seen: dict[int, Failure] = {}

    def post(self, failure: Failure) -> bool:
        """Tell every rank; False when the store cannot be reached."""
        try:
            self.store.set(self.prefix + str(failure.rank),
                           json.dumps({"message": failure.message, "cause": failure.cause}))
            self.store.add(self.prefix + COUNT, 1)
        except Exception as exc:  # noqa: BLE001 - the caller falls back to an error file
            log.warning("could not post rank %d's checkpoint failure to the store: %s",
                        failure.rank, exc)
            return False
        return True

    def posted(self) -> dict[int, Failure]:
        """Every failure posted so far, by rank (never blocks on a missing key)."""
        try:
            count = int(self.store.add(self.prefix + COUNT, 0))
            if count > len(self._seen):
                for rank in range(self.world):
                    key = self.prefix + str(rank)
                    if rank not in self._seen and self.store.check([key]):
                        value = json.loads(self.store.get(key))
                        self._seen[rank] = Failure(rank, value["message"], value["cause"])
        except Exception:  # noqa: BLE001 - a store gone means the job is ending anyway
            log.debug("cannot read checkpoint failures from the store", exc_info=True)
        return dict(self._seen)

    def post_key(self, name: str, value: Any) -> bool:
        """Set this save's key ``name`` (JSON); False when the store cannot be reached."""
        try:
            self.store.set(self.prefix + name, json.dumps(value))
        except Exception as exc:  # noqa: BLE001 - the store's own errors vary
            log.warning("could not post %r of this checkpoint save to the store: %s", name, exc)
            return False
        return True

    def wait_key(self, name: str, timeout_s: float) -> tuple[bool, Any]:
        """(True, value) once key ``name`` is set; (False, None) after
        ``timeout_s`` or when the store cannot be reached (rank 0, which
        holds it, has gone). Polls, every :data:`KEY_POLL_S` at first, then
        less and less often, up to :data:`KEY_POLL_MAX_S`."""
        deadline = time.monotonic() + timeout_s
        key, pause = self.prefix + name, KEY_POLL_S
        try:
            while not self.store.check([key]):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False, None
                time.sleep(min(pause, left))
                pause = min(pause * 2, KEY_POLL_MAX_S)
            return True, json.loads(self.store.get(key))
        except Exception:  # noqa: BLE001 - a store gone means the job is ending anyway
            log.debug("cannot read %r from the store", key, exc_info=True)
            return False, None

    def report(self) -> None:
        """This rank has reported the save's error (module docstring): count
        it; the last of all ranks sets ``reported/all``."""
        try:
            if int(self.store.add(self.prefix + REPORTED, 1)) >= self.world:
                self.store.set(self.prefix + ALL_REPORTED, "1")
        except Exception:  # noqa: BLE001 - a store gone means the job is ending anyway
            log.debug("cannot count this rank's report in the store", exc_info=True)

    def wait_for_reports(self, timeout_s: float) -> bool:
        """Block (the calling thread must be the only one using the store)
        until every rank has reported the save's error; False after
        ``timeout_s`` or when the store cannot be reached."""
        try:
            self.store.wait([self.prefix + ALL_REPORTED],
                            datetime.timedelta(seconds=max(timeout_s, 0.001)))
        except Exception:  # noqa: BLE001 - the store says "timeout" in its own way
            return False
        return True

    def clear(self) -> None:
        """Delete this save's keys (rank 0, once no rank reads them: module
        docstring); a store that cannot delete keeps them."""
        names = [OUTCOME, REPORTED, ALL_REPORTED, COUNT]
        with contextlib.suppress(Exception):  # a store gone or one without deletion
            if int(self.store.add(self.prefix + COUNT, 0)) > 0:  # failures were posted
                names += [str(rank) for rank in range(self.world)]
            for name in names:
                self.store.delete_key(self.prefix + name)

    def first(self, ranks: Optional[Iterable[int]] = None) -> Optional[Failure]:
        """The failure to report (among ``ranks``): :func:`first_failure`."""
        posted = self.posted()
        found = [posted[r] for r in (range(self.world) if ranks is None else ranks)
                 if r in posted]
        return first_failure(found)


def check_same(values: Sequence[Any], what: str) -> None:
    """One error naming which ranks gave which value when they differ."""
    if all(v == values[0] for v in values):
        return
    by_value: dict[str, list[int]] = {}
    for rank, value in enumerate(values):
        by_value.setdefault(repr(value), []).append(rank)
    parts = "; ".join(f"{describe_ranks(ranks)}: {value}" for value, ranks in by_value.items())
    raise CheckpointError(f"the ranks disagree on {what} ({parts}): every rank must pass the "
                          "same value")


def _by_text(statuses: Sequence[Optional[str]]) -> dict[str, list[int]]:
    """The ranks reporting each error text, in the order of the first rank."""
    by_text: dict[str, list[int]] = {}
    for rank, text in enumerate(statuses):
        if text:
            by_text.setdefault(text, []).append(rank)
    return by_text


def raise_first(statuses: Sequence[Optional[str]], what: str) -> None:
    """Raise (on every rank) the failure that rank 0 reported, else the
    lowest rank's, as it is - its cause first; different ones reported by
    other ranks follow it."""
    by_text = _by_text(statuses)
    if not by_text:
        return
    first, *others = by_text.items()
    also = "".join(f"\n  {what} also failed on {describe_ranks(ranks)}: {text}"
                   for text, ranks in others)
    raise CheckpointError(first[0] + also)


def raise_failures(statuses: Sequence[Optional[str]], what: str) -> None:
    """Raise (on every rank) when any rank reported an error; ranks that
    report the same error are named together."""
    by_text = _by_text(statuses)
    if not by_text:
        return
    if len(by_text) == 1:
        text, ranks = next(iter(by_text.items()))
        raise CheckpointError(f"{what} failed on {describe_ranks(ranks)}: {text}")
    lines = "\n".join(f"  {describe_ranks(ranks)}: {text}" for text, ranks in by_text.items())
    raise CheckpointError(f"{what} failed:\n{lines}")
