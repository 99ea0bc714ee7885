"""A run-store writer whose step-file writes run on a background thread (``BackgroundWriter``)."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from runstore.writer import RunWriter


class WriterErrors(RuntimeError):
    """Calls that failed on a :class:`BackgroundWriter`'s thread since the last drain (first one named)."""


class BackgroundWriter:
    """A :class:`RunWriter` whose step-file writes run on one background thread, in call order.

    Why: HDF5 writes of full tensors take a large share of a dumped step; on their own thread they overlap
    with the training thread's compute (torch releases the GIL in its kernels). The caller hands over
    arrays it will not touch again (private host copies). The queue is bounded by ``max_bytes`` of arrays
    waiting: a caller that outruns the disk waits rather than growing memory without limit.

    Contract kept from :class:`RunWriter`: :meth:`finish_step` returns only once the step file is complete
    under its final name (it drains the queue), so a run killed between steps loses nothing and a run
    killed mid-step leaves its ``.tmp`` file. A failing call never stops the calls after it; the failures
    are raised together (:class:`WriterErrors`) from the next :meth:`drain` / :meth:`finish_step`.
    """

    def __init__(self, writer: RunWriter, max_bytes: int = 256 << 20) -> None:
        self.writer = writer
        self.max_bytes = int(max_bytes)
        self._tasks: deque[tuple[Callable[[], Any], int]] = deque()
        self._pending = 0             # bytes of arrays queued
        self._busy = False
        self._errors: list[str] = []
        self._closed = False
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="xf-align-writer", daemon=True)
        self._thread.start()

    @property
    def root(self) -> Path:
        return self.writer.root

    @property
    def rank(self) -> int:
        return self.writer.rank

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._tasks and not self._closed:
                    self._cv.wait()
                if not self._tasks:
                    return
                fn, nbytes = self._tasks.popleft()
                self._busy = True
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 - reported at the next drain, never lost
                with self._cv:
                    self._errors.append(f"{type(exc).__name__}: {exc}")
            finally:
                with self._cv:
                    self._pending -= nbytes
                    self._busy = False
                    self._cv.notify_all()

    def _submit(self, fn: Callable[[], Any], nbytes: int = 0) -> None:
        with self._cv:
            if self._closed or not self._thread.is_alive():
                raise RuntimeError("background writer is closed")
            while self._pending and self._pending + nbytes > self.max_bytes:
                self._cv.wait()
            self._tasks.append((fn, nbytes))
            self._pending += nbytes
            self._cv.notify_all()

    def drain(self) -> None:
        """Wait until every queued call has run; raise the failures among them, if any."""
        with self._cv:
            while (self._tasks or self._busy) and self._thread.is_alive():
                self._cv.wait()
            errors, self._errors = self._errors, []
        if errors:
            more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
            raise WriterErrors(f"background write failed: {errors[0]}{more}")

    def put_array(self, step: int, key: str, array: np.ndarray, attrs: Mapping[str, Any] | None = None) -> None:
        """Queue :meth:`RunWriter.put_array`; ``array`` must not change afterwards (pass a private copy)."""
        self._submit(lambda: self.writer.put_array(step, key, array, attrs), int(getattr(array, "nbytes", 0)))

    def link_array(self, step: int, key: str, target: str) -> None:
        self._submit(lambda: self.writer.link_array(step, key, target))

    def put_table(self, step: int, group: str, columns: Mapping[str, Any],
                  attrs: Mapping[str, Any] | None = None) -> None:
        self._submit(lambda: self.writer.put_table(step, group, columns, attrs))

    def write_seed_batch(self, step: int, batch: Mapping[str, Any]) -> None:
        self._submit(lambda: self.writer.write_seed_batch(step, batch))

    def log_scalars(self, step: int, values: Mapping[str, float | int | str | None]) -> None:
        values = dict(values)
        self._submit(lambda: self.writer.log_scalars(step, values))

    def update_meta(self, values: Mapping[str, Any]) -> None:
        self.drain()
        self.writer.update_meta(values)

    def finish_step(self) -> None:
        """Queue the step file's close + rename and wait for it: on return the step is on disk."""
        self._submit(self.writer.finish_step)
        self.drain()

    def abandon_step(self) -> None:
        try:
            self.drain()
        finally:
            self.writer.abandon_step()

    def close(self) -> None:
        """Finish the open step, stop the thread, close the files; queued failures are raised."""
        try:
            if not self._closed:
                self._submit(self.writer.finish_step)
                self.drain()
        finally:
            with self._cv:
                self._closed = True
                self._cv.notify_all()
            self._thread.join()
            self.writer.close()
