"""``ReplicaClient``: the ``Client`` protocol (core/client.py) over several replicas of one server configuration
(an endpoint target whose ``base_url`` lists several URLs; harness/replica_set.py).

Each request goes to the replica with the fewest requests in flight (ties: round robin, so a sequential caller
alternates between the replicas).  A caller that keeps ``concurrency × replicas`` requests in flight (the suite
runner does: ``replica_count``) therefore keeps at most ``concurrency`` on each replica.  ``served_by()`` names
the replica (its base URL) that served the calling thread's last request, answered or failed: the suite runner
writes it into the item record (``replica``).  A replica that fails mid-run fails the requests sent to it (the
usual error accounting, ``RequestFailed`` / error results); nothing is retried on another replica, so the
records show which replica failed.  Prompt tokenization (``tokenizer()``) is the first replica's (every replica
serves the same model: checked when the target opens).  Thread-safe.
"""

from __future__ import annotations

import threading
from typing import Iterator, Optional

from kvbench.core import GenRequest, GenResult, ScoreRequest, ScoreResult

__all__ = ["ReplicaClient"]


class ReplicaClient:
    def __init__(self, clients: list):
        """``clients``: one ``OpenAIClient`` per replica, all with the same model id (the first one's is used)."""
        if not clients:
            raise ValueError("ReplicaClient needs at least one replica")
        self.clients = list(clients)
        self.model_id = self.clients[0].model_id
        self.replicas = [str(getattr(c, "base_url", i)) for i, c in enumerate(self.clients)]
        self.replica_count = len(self.clients)
        self._inflight = [0] * len(self.clients)
        self._served = [0] * len(self.clients)
        self._next = 0
        self._lock = threading.Lock()
        self._local = threading.local()

    # ------------------------------------------------------------------------------ dispatch
    def _pick(self) -> int:
        """The least-loaded replica (round robin among equals), counted in flight until ``_done``."""
        with self._lock:
            low = min(self._inflight)
            n = len(self._inflight)
            i = next((self._next + k) % n for k in range(n) if self._inflight[(self._next + k) % n] == low)
            self._next = (i + 1) % n
            self._inflight[i] += 1
            self._served[i] += 1
        self._local.replica = self.replicas[i]
        return i

    def _done(self, i: int) -> None:
        with self._lock:
            self._inflight[i] -= 1

    def served_by(self) -> Optional[str]:
        """The base URL of the replica that took the calling thread's last request (None before any)."""
        return getattr(self._local, "replica", None)

    def load(self) -> dict:
        """``{url: {"in_flight": n, "sent": n}}``: what each replica holds now and has been sent so far."""
        with self._lock:
            return {u: {"in_flight": f, "sent": s} for u, f, s in zip(self.replicas, self._inflight, self._served)}

    # ------------------------------------------------------------------------------ Client
    def generate(self, request: GenRequest) -> GenResult:
        i = self._pick()
        try:
            return self.clients[i].generate(request)
        finally:
            self._done(i)

    def stream(self, request: GenRequest) -> Iterator[str]:
        i = self._pick()
        try:
            yield from self.clients[i].stream(request)
        finally:
            self._done(i)

    def score(self, request: ScoreRequest) -> ScoreResult:
        i = self._pick()
        try:
            return self.clients[i].score(request)
        finally:
            self._done(i)

    def tokenizer(self):
        return self.clients[0].tokenizer()

    def info(self) -> dict:
        """The first replica's description with every replica's URL (``replicas``)."""
        info = dict(self.clients[0].info())
        info["replicas"] = list(self.replicas)
        return info

    def close(self) -> None:
        for c in self.clients:
            c.close()
