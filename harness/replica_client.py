"""``ReplicaClient``: the ``Client`` protocol (core/client.py) over several replicas of one server configuration
(an endpoint target whose ``base_url`` lists several URLs, or a server target launched ``replicas`` times;
harness/replica_set.py, harness/replica_targets.py).

* **Dispatch.** Each request goes to the replica in rotation with the fewest requests in flight (ties: round
  robin, so a sequential caller alternates between the replicas).  A caller that keeps ``concurrency ×
  replicas`` requests in flight (the suite runner does: ``replica_count``) therefore keeps at most
  ``concurrency`` on each replica.  ``pinned()`` holds one replica for the calling thread over several requests
  (a fidelity text's scoring and greedy continuation, an lm-eval document's requests): one slot for all of them.
* **Failover.** A request that fails with a connection error (``classify_error``: no response, refused, reset;
  after the replica client's own ``max_retries``) is sent again to another replica in rotation that has not
  tried it yet, so it is tried at most once per replica.  ``served_by()`` names the replica (its base URL) that
  finally served, or last failed, the calling thread's request: the suites write it into the item record
  (``replica``).  Other failures (an HTTP error status, a timeout, a stream cut off) are the request's own
  result and are not moved.
* **Out of rotation.** A replica whose requests fail with a connection error ``max_failures`` times in a row
  (a target's ``replica_max_failures``, ``--replica-max-failures``; default 3; any success resets the count) gets no further request for the rest of the target session;
  ``take_out`` does the same for a failure seen elsewhere (a prefix-cache flush).  ``health()`` says which are
  out and why (the cell's ``summary.json``: ``replica_health``).  When the last replica goes, every request
  raises ``TargetGone``: the suite stops and the cell fails (``--resume`` redoes it).

Prompt tokenization (``tokenizer()``) and ``info()`` are the first replica in rotation's (every replica serves
the same model: checked when the target opens).  Thread-safe.
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

from kvbench.core import GenRequest, GenResult, ScoreRequest, ScoreResult, TargetGone, classify_error
from kvbench.harness.replica_set import DEFAULT_REPLICA_MAX_FAILURES

__all__ = ["ReplicaClient", "MAX_FAILURES"]

log = logging.getLogger(__name__)

MAX_FAILURES = DEFAULT_REPLICA_MAX_FAILURES  # connection failures in a row that take a replica out of rotation


class ReplicaClient:
    def __init__(self, clients: list, max_failures: int = MAX_FAILURES):
        """``clients``: one ``OpenAIClient`` per replica, all with the same model id (the first one's is used)."""
        if not clients:
            raise ValueError("ReplicaClient needs at least one replica")
        if max_failures < 1:
            raise ValueError(f"max_failures must be at least 1, got {max_failures}")
        self.clients = list(clients)
        self.model_id = self.clients[0].model_id
        self.replicas = [str(getattr(c, "base_url", i)) for i, c in enumerate(self.clients)]
        self.replica_count = len(self.clients)
        self.max_failures = int(max_failures)
        n = len(self.clients)
        self._inflight, self._served, self._fails = [0] * n, [0] * n, [0] * n
        self._out: dict[int, dict] = {}  # replica index -> {"url", "reason", "at"}
        self.failovers = 0  # requests sent again to another replica after a connection error
        self._next = 0
        self._lock = threading.Lock()
        self._local = threading.local()

    # ------------------------------------------------------------------------------ rotation
    def _pick(self, tried: frozenset = frozenset()) -> Optional[int]:
        """The least-loaded replica in rotation not in ``tried`` (round robin among equals), counted in flight
        until ``_release``; None when every replica in rotation has tried; ``TargetGone`` when none is left."""
        with self._lock:
            n = len(self.clients)
            if len(self._out) == n:
                raise TargetGone(self.gone_text())
            free = [i for i in range(n) if i not in self._out and i not in tried]
            if not free:
                return None
            low = min(self._inflight[i] for i in free)
            i = next((self._next + k) % n for k in range(n)
                     if (self._next + k) % n in free and self._inflight[(self._next + k) % n] == low)
            self._next = (i + 1) % n
            self._inflight[i] += 1
            self._served[i] += 1
        return i

    def _release(self, i: int) -> None:
        with self._lock:
            self._inflight[i] -= 1

    def gone_text(self) -> str:
        why = "; ".join(f"{o['url']}: {o['reason']}" for o in self._out.values())
        return f"every replica of the target is out of rotation ({why})"

    def take_out(self, url: str, reason: str) -> None:
        """Take the replica ``url`` out of rotation (no request goes to it any more), saying why."""
        i = self.replicas.index(url)
        with self._lock:
            if i in self._out:
                return
            self._out[i] = {"url": url, "reason": reason, "at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
            left = len(self.clients) - len(self._out)
        log.warning("replica %s taken out of rotation (%d left): %s", url, left, reason)

    def _failed(self, i: int, error: BaseException) -> None:
        with self._lock:
            self._fails[i] += 1
            out = self._fails[i] >= self.max_failures
        if out:
            self.take_out(self.replicas[i], f"{self.max_failures} requests in a row failed with a connection error; "
                                            f"last: {type(error).__name__}: {error}")

    def live(self) -> list[str]:
        """The base URLs of the replicas in rotation, in their order."""
        with self._lock:
            return [u for i, u in enumerate(self.replicas) if i not in self._out]

    def health(self) -> dict:
        """``replicas`` (every URL), ``in_rotation``, ``out`` (``url``, ``reason``, ``at``), ``failovers``,
        ``sent`` (requests sent to each replica) since the target opened, and ``max_failures`` (the connection
        failures in a row that take a replica out)."""
        with self._lock:
            return {"replicas": list(self.replicas), "max_failures": self.max_failures,
                    "in_rotation": [u for i, u in enumerate(self.replicas) if i not in self._out],
                    "out": [dict(o) for _, o in sorted(self._out.items())], "failovers": self.failovers,
                    "sent": dict(zip(self.replicas, self._served))}

    def load(self) -> dict:
        """``{url: {"in_flight": n, "sent": n}}``: what each replica holds now and has been sent so far."""
        with self._lock:
            return {u: {"in_flight": f, "sent": s} for u, f, s in zip(self.replicas, self._inflight, self._served)}

    # ------------------------------------------------------------------------------ dispatch
    def served_by(self) -> Optional[str]:
        """The base URL of the replica that served (or last failed) the calling thread's last request."""
        return getattr(self._local, "replica", None)

    @contextmanager
    def pinned(self) -> Iterator[None]:
        """The calling thread's requests inside go to one replica (one slot held throughout); a connection
        failure moves the pin to the replica that serves the request instead."""
        if getattr(self._local, "pin", None) is not None:  # already pinned: nested use keeps the pin
            yield
            return
        i = self._pick()
        if i is None:  # cannot happen with nothing tried; keep the type checker and readers sure
            raise TargetGone(self.gone_text())
        self._local.pin = i
        self._local.replica = self.replicas[i]
        try:
            yield
        finally:
            self._release(self._local.pin)
            self._local.pin = None

    def _attempt(self, call: Callable):
        """``call(client)`` on a replica, sent again to another one on a connection error (module docstring);
        ``(result, replica index)`` with that replica's slot still held unless the thread is pinned."""
        pin = getattr(self._local, "pin", None)
        i = pin if pin is not None else self._pick()
        tried: set = set()
        while True:
            self._local.replica = self.replicas[i]
            try:
                result = call(self.clients[i])
            except Exception as e:
                if classify_error(e) != "connection":
                    self._hand_back(i, pin)
                    raise
                self._failed(i, e)
                tried.add(i)
                try:
                    nxt = self._pick(frozenset(tried))
                except TargetGone as gone:
                    self._hand_back(i, pin)
                    raise gone from e
                if nxt is None:  # every replica in rotation tried it: the request's own failure
                    self._hand_back(i, pin)
                    raise
                with self._lock:
                    self.failovers += 1
                log.info("request failed on %s (%s); sent again to %s", self.replicas[i], e, self.replicas[nxt])
                self._release(i)
                i = nxt
                if pin is not None:
                    pin = self._local.pin = nxt
                continue
            with self._lock:
                self._fails[i] = 0
            return result, i

    def _hand_back(self, i: int, pin: Optional[int]) -> None:
        if pin is None:
            self._release(i)

    def _call(self, call: Callable):
        result, i = self._attempt(call)
        self._hand_back(i, getattr(self._local, "pin", None))
        return result

    # ------------------------------------------------------------------------------ Client
    def generate(self, request: GenRequest) -> GenResult:
        return self._call(lambda c: c.generate(request))

    def score(self, request: ScoreRequest) -> ScoreResult:
        return self._call(lambda c: c.score(request))

    def stream(self, request: GenRequest) -> Iterator[str]:
        """Text pieces of one streamed completion; failover only until its first piece arrives."""
        def first(c):
            it = iter(c.stream(request))
            return next(it, None), it

        (head, rest), i = self._attempt(first)
        try:
            if head is not None:
                yield head
                yield from rest
        finally:
            self._hand_back(i, getattr(self._local, "pin", None))

    def _first_live(self):
        with self._lock:
            i = next((i for i in range(len(self.clients)) if i not in self._out), 0)
        return self.clients[i]

    def tokenizer(self):
        return self._first_live().tokenizer()

    def info(self) -> dict:
        """The first replica in rotation's description with every replica's URL (``replicas``)."""
        info = dict(self._first_live().info())
        info["replicas"] = list(self.replicas)
        return info

    def close(self) -> None:
        for c in self.clients:
            c.close()
