"""The waiting queue: which waiting request the scheduler admits next, and in which order it
keeps (and preempts) running ones. Pure Python.

Policies (`SchedulerConfig.scheduling_policy`, vLLM's `--scheduling-policy`):

    fcfs       arrival order; every request's priority is 0 (another value is refused)
    priority   (priority, arrival): a LOWER value is served first, and a waiting request may
               preempt a running request of strictly worse priority (`Scheduler`)

`order_key(req)` is the policy's order, ties by request id. The scheduler keeps `running` sorted
by it, so the preemption victim is always `running[-1]`: the worst (priority, arrival), under
fcfs the newest. A preempted request comes back here in its own place.

Fair share between clients (both policies). A client is what a request names in `client_id`
(the server: a hash of the API key it presented, else the body's `user`; None: one anonymous
client). Among waiting requests of the best priority, the next admitted is the first (by
`order_key`) of the client with the least service, as in start-time fair queuing:

    F[c]  client c's service: each token the scheduler schedules for c's requests (prefill
          chunks, decodes, drafts) adds one (`charge`)
    V     the virtual time: F[c] of the client of the latest admission (never decreases)
    a request of c enters the queue while c has none of its priority waiting:
          F[c] = max(F[c], V)              (an idle client banks no credit)
    admit the head of the client with the least (priority of its head, F[c], head's order)

Bound. While the waiting requests share one priority (always under fcfs), every client with a
waiting request has F >= V: an admission takes the least F, and V becomes that F. A client c
that starts waiting with F[c] <= V (a new client, or one that had no more than its share) gets
F[c] = V, so another client goes before it only with F = V and an earlier head, and that
admission raises its F above V (its first chunk is charged, at least one token). Hence c's
request is admitted before any other client is admitted twice; against one client flooding the
queue it is the next admission, or the one after if the flooder was not admitted since it
started waiting. Admission is head-of-line (when the chosen request does not fit, nobody
overtakes it), so the bound counts admissions, not steps. Across priorities there is no such
bound, by design: a request of worse priority waits while better ones keep arriving, and is
admitted once none of them waits.

Idle clients whose service is at most V are forgotten (they would restart at V anyway); a client
charged while forgotten counts from V.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator

from deepinfer.config import SCHEDULING_POLICIES
from deepinfer.engine.request import Request
from deepinfer.sampling_params import short_repr


class RequestQueue:
    """Waiting requests by client, each client's sorted by `order_key`; see the module docstring."""

    preemptive = False  # may a waiting request preempt a running one of worse priority?

    def __init__(self):
        self._by_client: dict[str | None, list[Request]] = {}  # clients with waiting requests
        self._service: dict[str | None, int] = {}  # F[c]
        self.virtual_time = 0  # V

    @staticmethod
    def order_key(req: Request) -> tuple:
        """The policy's order of two requests (lower first): here arrival; a subclass may refine it."""
        return (req.arrival_time, req.request_id)

    def check(self, req: Request) -> None:
        """ValueError naming the field and the value when req's priority or client_id is invalid."""
        if isinstance(req.priority, bool) or not isinstance(req.priority, int):
            raise ValueError(f"priority must be an integer, got {short_repr(req.priority)}")
        if req.client_id is not None and not isinstance(req.client_id, str):
            raise ValueError(f"client_id must be a string or None, got {short_repr(req.client_id)}")

    # ---- queue --------------------------------------------------------------------------
    def __len__(self) -> int:
        return sum(len(reqs) for reqs in self._by_client.values())

    def __bool__(self) -> bool:
        return bool(self._by_client)

    def __iter__(self) -> Iterator[Request]:
        """Every waiting request in the policy's order (fair share aside)."""
        return iter(sorted((r for reqs in self._by_client.values() for r in reqs), key=self.order_key))

    def __getitem__(self, index: int) -> Request:
        return list(self)[index]

    def add(self, req: Request) -> None:
        """Queue a new, preempted or restarted request in its place."""
        reqs = self._by_client.setdefault(req.client_id, [])
        if all(r.priority != req.priority for r in reqs):  # c starts waiting at this priority
            self._service[req.client_id] = max(self._service.get(req.client_id, 0), self.virtual_time)
        bisect.insort(reqs, req, key=self.order_key)

    def peek(self) -> Request | None:
        """The request to admit next (None when empty)."""
        heads = [reqs[0] for reqs in self._by_client.values()]
        return min(heads, key=self._admission_key, default=None)

    def admit(self, req: Request) -> None:
        """Take out req, the `peek()` just admitted: the virtual time moves to its client's service."""
        self.virtual_time = max(self.virtual_time, self._service.get(req.client_id, self.virtual_time))
        self.remove(req)
        idle = [c for c, f in self._service.items() if f <= self.virtual_time and c not in self._by_client]
        for client in idle:
            del self._service[client]

    def remove(self, req: Request) -> None:
        """Take out a waiting request (admitted or aborted); ValueError if it is not here."""
        reqs = self._by_client.get(req.client_id, [])
        reqs.remove(req)
        if not reqs:
            del self._by_client[req.client_id]

    def charge(self, req: Request, num_tokens: int) -> None:
        """Count `num_tokens` scheduled for req to its client's service."""
        client = req.client_id
        self._service[client] = self._service.get(client, self.virtual_time) + num_tokens

    def service(self, client_id: str | None) -> int:
        """F[c] of a client (V for a client not known)."""
        return self._service.get(client_id, self.virtual_time)

    def _admission_key(self, head: Request) -> tuple:
        key = self.order_key(head)
        return (*key[:-2], self.service(head.client_id), *key[-2:])  # (policy rank, F[c], arrival, id)


class FCFSQueue(RequestQueue):
    """fcfs: arrival order (the base order); a request's priority must be 0."""

    def check(self, req: Request) -> None:
        super().check(req)
        if req.priority != 0:
            raise ValueError(f"priority must be 0 under the fcfs scheduling policy, got {req.priority!r}; start "
                             f"the engine with scheduling_policy='priority' (--scheduling-policy priority)")


class PriorityQueue(RequestQueue):
    """priority: (priority, arrival), lower first; a waiting request preempts worse running ones."""

    preemptive = True

    @staticmethod
    def order_key(req: Request) -> tuple:
        return (req.priority, req.arrival_time, req.request_id)


def make_request_queue(policy: str) -> RequestQueue:
    """The waiting queue of a scheduling policy ("fcfs" or "priority")."""
    queues = {"fcfs": FCFSQueue, "priority": PriorityQueue}
    if policy not in queues:
        raise ValueError(f"scheduling_policy must be one of {', '.join(map(repr, SCHEDULING_POLICIES))}, "
                         f"got {policy!r}")
    return queues[policy]()
