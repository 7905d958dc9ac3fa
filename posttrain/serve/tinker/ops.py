"""The training side's worker: one thread runs every training operation, each model's in `seq_id` order.

A Tinker training client numbers its operations (`seq_id` 1, 2, 3, ... after `create_model`) and may submit the
next before the previous one finished (the cookbook sends `forward_backward` and `optim_step`, then waits on both),
or, for a large batch, several chunks at once in any order. `OrderedOps.submit(key, seq, op)` queues an operation
under its model's key: it runs when every lower `seq_id` of that model has run (an operation submitted ahead of
its turn waits), in the order operations became runnable across models. Operations are computed when submitted,
not when their results are polled. The same `(key, seq)` submitted again (a client retrying a request whose answer
was lost) gets the first submission's request id back and runs once. An operation that fails still takes its turn,
so the ones after it are never stuck behind it.

`submit_now(op)` queues an operation outside any model's order (creating a model). Each operation is a callable
that returns its `Reply`; an exception becomes the request's error (a `BadInput` or ValueError: a user error with
its message; anything else: a server error, logged with its traceback, never sent to the client).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable

from posttrain.serve.tinker.futures import Futures, Reply

__all__ = ["OrderedOps", "reply_of"]

log = logging.getLogger("posttrain.serve.tinker")


def reply_of(run: Callable[[], Reply], what: str) -> Reply:
    """`run()`, or its exception as an error reply (ValueError and its kinds: user; anything else: server)."""
    try:
        return run()
    except (ValueError, FileNotFoundError, FileExistsError, KeyError) as e:
        message = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        return Reply.error(f"{what}: {message}", "user")
    except Exception as e:  # noqa: BLE001 - reported to the client in one line; the log has the traceback
        log.exception("tinker: %s failed", what)
        return Reply.error(f"{what}: internal error ({type(e).__name__}: {e})", "server")


@dataclasses.dataclass
class _Op:
    rid: str
    what: str
    run: Callable[[], Reply]
    key: str | None = None


@dataclasses.dataclass
class _Order:
    next: int
    waiting: dict[int, _Op] = dataclasses.field(default_factory=dict)
    seen: dict[int, str] = dataclasses.field(default_factory=dict)


class OrderedOps:
    """The worker thread and the per-model orders (module docstring)."""

    def __init__(self, futures: Futures):
        self.futures = futures
        self._orders: dict[str, _Order] = {}
        self._ready: collections.deque[_Op] = collections.deque()
        self._cv = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="tinker-training", daemon=True)
        self._thread.start()

    def open(self, key: str, first_seq: int = 1) -> None:
        """Starts the order of model `key`: its next operation is `first_seq`."""
        with self._cv:
            self._orders.setdefault(key, _Order(first_seq))

    def close(self, key: str) -> None:
        with self._cv:
            self._orders.pop(key, None)

    def submit(self, key: str, seq: int, what: str, run: Callable[[], Reply]) -> str:
        """Queues `run` as operation `seq` of model `key`; returns its request id (module docstring)."""
        with self._cv:
            order = self._orders.get(key)
            if order is None:
                return self._failed(f"{what}: unknown model_id {key!r}")
            if seq in order.seen:
                return order.seen[seq]
            if seq < order.next:
                return self._failed(f"{what}: seq_id {seq} of model {key!r} was used already (next: {order.next})")
            op = _Op(self.futures.new(), what, run, key)
            order.seen[seq] = op.rid
            order.waiting[seq] = op
            self._promote(order)
            return op.rid

    def submit_now(self, what: str, run: Callable[[], Reply]) -> str:
        """Queues `run` outside any model's order; returns its request id."""
        with self._cv:
            op = _Op(self.futures.new(), what, run)
            self._ready.append(op)
            self._cv.notify()
            return op.rid

    def stop(self, timeout: float | None = 10.0) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        self._thread.join(timeout)

    def _failed(self, message: str) -> str:
        rid = self.futures.new()
        self.futures.fail(rid, message)
        return rid

    def _promote(self, order: _Order) -> None:
        """Moves the model's next operation, if it has arrived, to the ready queue (caller holds the lock)."""
        op = order.waiting.pop(order.next, None)
        if op is not None:
            self._ready.append(op)
            self._cv.notify()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._ready and not self._stopping:
                    self._cv.wait()
                if self._stopping:
                    return
                op = self._ready.popleft()
            t0 = time.perf_counter()
            reply = reply_of(op.run, op.what)
            log.info("tinker: %s %s %s in %.3fs", op.what, op.key or "-", "failed" if reply.failed else "done",
                     time.perf_counter() - t0)
            self.futures.resolve(op.rid, reply)
            if op.key is not None:
                with self._cv:
                    order = self._orders.get(op.key)
                    if order is not None:
                        order.next += 1
                        order.seen.pop(order.next - 1024, None)  # a retry comes soon after, or not at all
                        self._promote(order)
