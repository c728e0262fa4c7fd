"""Preemption during evaluation: stop at the next batch when SLURM (or a user) sends a signal.

SLURM sends ``SIGUSR1`` (with ``--signal=SIGUSR1@90``) before a time limit and ``SIGTERM`` before
it kills a job. Lightning handles both during training steps, but an epoch-end evaluation or a
standalone ``unicon evaluate`` can run for many minutes between steps. Inside
:func:`watch_signals`, these signals only set a flag (and still reach the handler that was
installed before, e.g. Lightning's); the long evaluation loops call :func:`check` once per batch,
which raises :class:`Preempted`. The epoch-end callback then writes ``last.ckpt`` and the run ends;
``unicon`` prints one line and exits with ``128 + signal``. Drift chains are journaled per batch, so
a preempted drift evaluation resumes where it stopped.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Iterator, Sequence, TypeVar

from unicon.progress import track

T = TypeVar("T")
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preempted(Exception):
    """A preemption signal arrived during an evaluation; ``checkpoint`` is set when one was written."""

    def __init__(self, signum: int, checkpoint: str | None = None, outputs: str | None = None):
        self.signum, self.checkpoint, self.outputs = signum, checkpoint, outputs
        super().__init__(f"preempted by signal {signal.Signals(signum).name}")


_received: list[int] = []


def check() -> None:
    """Raise :class:`Preempted` if a watched signal arrived (call it once per batch)."""
    if _received:
        raise Preempted(_received[0])


def batches(items: Sequence[T], size: int, description: str) -> Iterator[Sequence[T]]:
    """``items`` in batches of ``size``, shown as progress (:func:`unicon.progress.track`), with a
    :func:`check` before each batch: the batch loop of every evaluation."""
    for start in track(range(0, len(items), size), description, unit="batches"):
        check()
        yield items[start:start + size]


@contextmanager
def watch_signals() -> Iterator[None]:
    """Within the block, SIGTERM/SIGUSR1 set the flag :func:`check` reads, then call the previous
    handler if it was a Python function. Handlers are restored on exit. Outside the main thread
    (where handlers cannot be installed) this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.getsignal(sig) for sig in SIGNALS}

    def handler(signum, frame):
        _received.append(signum)
        prev = previous.get(signum)
        if callable(prev):
            prev(signum, frame)

    _received.clear()
    for sig in SIGNALS:
        signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, prev in previous.items():
            signal.signal(sig, prev if prev is not None else signal.SIG_DFL)
        _received.clear()
