"""Stack requests of a running job, for the launcher's event loop
(supervisor.py): ``dsrun stack`` through the control socket, and the
stacks a ``--timeout`` collects before it stops the job. Every agent still
running is asked; the answers are streamed back as ``[host:rank]`` lines,
and a collection ends when every asked agent has answered (``stack_end``)
or gone, or at its deadline, naming the hosts that did not answer.
"""

from __future__ import annotations

import queue
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dsrun.launcher.control import NO_ANSWER
from dsrun.launcher.watch import StackCollection

if TYPE_CHECKING:
    from dsrun.launcher.backends.base import JobHandle
    from dsrun.launcher.supervisor import Watch, _State

#: Seconds agents get to send the stacks ``dsrun stack`` asked for.
QUERY_STACK_WAIT = 10.0


class StackRequests:
    """The Supervisor's stack requests (a mixin: the state is the Supervisor's)."""

    state: _State
    handle: JobHandle
    watch: Watch

    def _stop(self, interrupt: bool = False, failure: bool = False) -> None:
        raise NotImplementedError  # the Supervisor's

    def _drop_silent(self, silent: set[int]) -> None:
        raise NotImplementedError  # the Supervisor's

    def _ask_stacks(self, deadline: float, write: Callable[[str], object],
                    close: Callable[[], None] | None = None) -> StackCollection:
        st = self.state
        req = st.next_req
        st.next_req += 1
        asked = st.open_nodes - st.done
        collection = StackCollection(req, set(asked), deadline, write, close)
        st.collections[req] = collection
        self.handle.send_all({"cmd": "stack", "req": req}, only=sorted(asked))
        return collection

    def _serve_queries(self, now: float) -> None:
        queries = self.watch.queries
        while queries is not None:
            try:
                query = queries.get_nowait()
            except queue.Empty:
                return
            self._ask_stacks(now + QUERY_STACK_WAIT, query.write, query.close)

    def _stack_event(self, index: int, host: str, msg: dict[str, Any]) -> None:
        collection = self.state.collections.get(msg.get("req"))  # type: ignore[arg-type]
        if collection is None:
            return
        if msg.get("ev") == "stack":
            collection.answer(host, int(msg.get("rank", -1)), msg.get("text"),
                              bool(msg.get("stopped")))
        else:
            collection.ended([index])

    def _check_collections(self, now: float) -> None:
        st = self.state
        for collection in list(st.collections.values()):
            if collection.complete(now):
                if collection is st.timeout_stacks:
                    self._drop_silent(collection.pending)
                self._finish_collection(collection)
                if collection is st.timeout_stacks:
                    self._stop()

    def _finish_collection(self, collection: StackCollection) -> None:
        st = self.state
        st.collections.pop(collection.req, None)
        if collection.pending:
            silent = ", ".join(sorted({st.hosts[i] for i in collection.pending}))
            collection.write(f"{NO_ANSWER}{silent} (host down or unreachable?)")
        if collection.close is not None:
            collection.close()
