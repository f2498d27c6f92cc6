"""The launch time stamp and the loading status line, shared by chat, generate and serve: every
"N s after launch" the CLI prints is measured from the moment the ``asyncengine.cli`` package
started importing (its ``__init__`` imports this module first), the nearest this code gets to the
process start.
"""
from __future__ import annotations

import sys
import time

LAUNCHED = time.monotonic()


class LoadStatus:
    """One status line on stderr while the model loads: rewritten in place on a terminal, a single
    line otherwise. Fed by the loader's INFO log records."""

    def __init__(self, what: str) -> None:
        import logging

        self.tty = sys.stderr.isatty()
        self._write(f"asyncengine: loading {what} ...", final=not self.tty)
        self.handler = logging.Handler(logging.INFO)
        self.handler.emit = lambda rec: self._write(f"asyncengine: {rec.getMessage()} ...")
        self.logger = logging.getLogger("asyncengine.models")
        self.logger.addHandler(self.handler)
        self._level = self.logger.level
        self.logger.setLevel(logging.INFO)

    def _write(self, text: str, final: bool = False) -> None:
        if self.tty:
            sys.stderr.write("\r\033[K" + text + ("\n" if final else ""))
            sys.stderr.flush()
        elif final:
            print(text, file=sys.stderr, flush=True)

    def step(self, text: str) -> None:
        """A later stage of the start (e.g. warming up), on a terminal only, as the loader's lines."""
        self._write(f"asyncengine: {text} ...")

    def done(self, text: str) -> None:
        self.logger.removeHandler(self.handler)
        self.logger.setLevel(self._level)
        self._write(f"asyncengine: {text} ({time.monotonic() - LAUNCHED:.1f} s after launch)", final=True)
