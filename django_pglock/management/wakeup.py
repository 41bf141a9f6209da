"""A pipe that wakes ``locked_run``'s wait for its job from another thread (the lease's loss)."""

from __future__ import annotations

import contextlib
import os
import threading

__all__ = ["Wakeup"]


class Wakeup:
    """A pipe that other threads write to, to wake a ``select`` (safe after ``close``)."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)
        self._lock = threading.Lock()

    def fileno(self) -> int:
        """The read end, for ``select``."""
        return self._read

    def poke(self) -> None:
        """Wake the ``select`` (from any thread; nothing once closed)."""
        with self._lock, contextlib.suppress(OSError):
            if self._write >= 0:
                os.write(self._write, b"x")

    def drain(self) -> None:
        """Read the pokes that woke it."""
        with contextlib.suppress(OSError):
            os.read(self._read, 512)

    def close(self) -> None:
        """Close both ends; later pokes do nothing."""
        with self._lock:
            os.close(self._read)
            os.close(self._write)
            self._read = self._write = -1
