"""Counting compiles with JAX's own events: each backend compile (or load of a compiled program from the persistent
compilation cache) is reported as the `jax.monitoring` duration event `/jax/core/compile/backend_compile_duration`,
with the program's name (`fun_name`, e.g. "jit(_prefill)").

    with count_compiles() as compiles:
        sampler.generate(...)
    assert compiles.total == 0
    assert compiles["_prefill"] == 1  # programs whose name holds "_prefill"

The events are process-wide: compiles in other threads while the block runs count too.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator

import jax

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class CompileCounter:
    """Compiles seen since it started, by program name (`names`: a Counter of JAX's `fun_name`s)."""

    def __init__(self):
        self.names: collections.Counter = collections.Counter()

    def __call__(self, event: str, duration: float, **kwargs) -> None:
        if event == BACKEND_COMPILE_EVENT:
            self.names[str(kwargs.get("fun_name", "?"))] += 1

    @property
    def total(self) -> int:
        return sum(self.names.values())

    def __getitem__(self, name: str) -> int:
        """Compiles of programs whose name contains `name` ("_prefill" counts "jit(_prefill)")."""
        return sum(n for k, n in self.names.items() if name in k)

    def __repr__(self) -> str:
        return f"CompileCounter({dict(self.names)})"


@contextlib.contextmanager
def count_compiles() -> Iterator[CompileCounter]:
    """A `CompileCounter` that counts the compiles of the `with` block."""
    counter = CompileCounter()
    jax.monitoring.register_event_duration_secs_listener(counter)
    try:
        yield counter
    finally:
        jax.monitoring.unregister_event_duration_listener(counter)
