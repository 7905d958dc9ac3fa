"""The futures table behind `retrieve_future`: every accepted request gets a request id at once and its result later.

A request handler creates an entry (`new`) and answers `{"request_id": ...}` straight away; the worker that runs
the operation settles it with a `Reply` (`resolve`: a protobuf or JSON payload) or an error (`fail`: the message
and its category, `user` for a bad request, `server` for a failure of ours). `retrieve_future` waits on the entry
for at most `poll_s` seconds (`wait`): settled -> the payload (or `{"error", "category"}`), still running -> None,
which the route answers with `{"type": "try_again"}` so the client polls again without spinning. Settled entries
are kept `keep_s` seconds (a client may fetch a result twice after a lost connection), then dropped.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import secrets
import threading
import time
from typing import Any

__all__ = ["Futures", "Reply"]


@dataclasses.dataclass(frozen=True)
class Reply:
    """A settled request: `proto` bytes (served as application/x-protobuf) or a `json` object."""

    proto: bytes | None = None
    json: dict[str, Any] | None = None

    @classmethod
    def error(cls, message: str, category: str = "user") -> Reply:
        return cls(json={"error": message, "category": category})

    @property
    def failed(self) -> bool:
        return self.json is not None and "error" in self.json


class Futures:
    """Request id -> its result (module docstring)."""

    def __init__(self, keep_s: float = 600.0):
        self.keep_s = keep_s
        self._entries: dict[str, tuple[concurrent.futures.Future, list[float]]] = {}
        self._lock = threading.Lock()
        self._counter = itertools.count(1)
        self._prefix = secrets.token_hex(4)

    def new(self) -> str:
        """A fresh request id with an unsettled entry."""
        rid = f"{self._prefix}-{next(self._counter)}"
        fut: concurrent.futures.Future = concurrent.futures.Future()
        done_at = [0.0]
        fut.add_done_callback(lambda _: done_at.__setitem__(0, time.monotonic()))
        with self._lock:
            self._forget_old()
            self._entries[rid] = (fut, done_at)
        return rid

    def resolve(self, rid: str, reply: Reply) -> None:
        with self._lock:
            entry = self._entries.get(rid)
        if entry is not None and not entry[0].done():
            entry[0].set_result(reply)

    def fail(self, rid: str, message: str, category: str = "user") -> None:
        self.resolve(rid, Reply.error(message, category))

    def settled(self, rid: str) -> Reply | None:
        """The entry's reply if it is settled, else None (an unknown id: None)."""
        with self._lock:
            entry = self._entries.get(rid)
        return entry[0].result() if entry is not None and entry[0].done() else None

    def known(self, rid: str) -> bool:
        with self._lock:
            return rid in self._entries

    async def wait(self, rid: str, poll_s: float) -> Reply | None:
        """The entry's reply once settled, within `poll_s` seconds; None while it is still running. An unknown id is
        a KeyError."""
        with self._lock:
            entry = self._entries.get(rid)
        if entry is None:
            raise KeyError(rid)
        fut = entry[0]
        if not fut.done():
            await asyncio.wait([asyncio.wrap_future(fut)], timeout=poll_s)
        return fut.result() if fut.done() else None

    def _forget_old(self) -> None:
        now = time.monotonic()
        old = [rid for rid, (fut, done_at) in self._entries.items()
               if fut.done() and done_at[0] and now - done_at[0] > self.keep_s]
        for rid in old:
            del self._entries[rid]
