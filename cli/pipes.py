"""Standard output into a pipe that closes early (`llmtrace run ... | head`): the rest of the report is dropped
quietly, the run goes on and still writes its files, and no BrokenPipeError traceback reaches the terminal."""

from __future__ import annotations

import os
from typing import Any, TextIO


class PipeGuard:
    """A text stream that forwards to `stream` until a write or flush meets a closed pipe, then discards.

    On the first broken write, the stream's file descriptor is pointed at /dev/null, so that the interpreter's own
    flush at exit (of whatever the stream still buffers) finds a sink instead of raising again.
    """

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self.broken = False

    def write(self, text: str) -> int:
        if not self.broken:
            try:
                return self._stream.write(text)
            except BrokenPipeError:
                self._drop()
        return len(text)

    def flush(self) -> None:
        if not self.broken:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._drop()

    def _drop(self) -> None:
        self.broken = True
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())
            os.close(devnull)
        except (OSError, ValueError):  # no real descriptor (a test's stream): nothing is flushed at exit anyway
            pass

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding, buffer...: the real stream's
        return getattr(self._stream, name)
