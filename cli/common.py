"""What every command shares: user mistakes become one line on stderr and exit code 2."""
from __future__ import annotations

import contextlib
import functools
import logging
import signal
import sys
import threading
import traceback

import click

from ..errors import InteropError, RankStopped

# Signals that end a command the way Ctrl-C does: its temporary output is removed on the way out.
STOP_SIGNALS = {signal.SIGINT: "interrupted", signal.SIGTERM: "terminated", signal.SIGHUP: "hung up"}


class Stopped(KeyboardInterrupt):
    """A stop signal (SIGINT, SIGTERM, SIGHUP), raised in the main thread like Ctrl-C's KeyboardInterrupt so
    that every `finally` and cleanup runs; the command then exits 128 + the signal."""

    def __init__(self, signum: int):
        super().__init__(STOP_SIGNALS.get(signum, f"signal {signum}"))
        self.signum = signum


@contextlib.contextmanager
def stop_signals_raise():
    """SIGINT, SIGTERM and SIGHUP raise `Stopped` once; later ones are ignored, so that the cleanup the
    first one started (removing a temporary directory, stopping training ranks) is not cut short."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    stopping = []

    def handler(signum, frame):
        if not stopping:
            stopping.append(signum)
            raise Stopped(signum)

    previous = {}
    try:
        for signum in STOP_SIGNALS:
            previous[signum] = signal.signal(signum, handler)
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


def stopping_cleanly(fn):
    """Run `fn` with stop signals raised as `Stopped` (see `stop_signals_raise`)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with stop_signals_raise():
            return fn(*args, **kwargs)
    return wrapper


VERBOSE = {"level": 0}


def set_verbose(level: int) -> None:
    """-v: tracebacks behind `error:` lines, and the library's INFO logging; -vv: DEBUG logging."""
    VERBOSE["level"] = level
    if level:
        logging.basicConfig(level=logging.DEBUG if level > 1 else logging.INFO, stream=sys.stderr,
                            format="%(levelname)s %(name)s: %(message)s")


def _traceback() -> None:
    if VERBOSE["level"]:
        traceback.print_exc(file=sys.stderr)


def user_errors(fn):
    """Run a command body; an InteropError prints `error: ...` and exits 2, an OSError (disk full,
    permission denied) likewise with exit 1; bugs keep their traceback."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except RankStopped:  # a rank of a distributed conversion that another's failure stopped: that one says it
            sys.exit(2)
        except InteropError as exc:
            _traceback()
            click.echo(f"error: {exc}", err=True)
            sys.exit(2)
        except OSError as exc:  # the machine's trouble (a full disk, no permission), not the input's: exit 1
            _traceback()
            where = f"{exc.filename}: " if exc.filename else ""
            click.echo(f"error: {where}{exc.strerror or exc}", err=True)
            sys.exit(1)
        except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM / SIGHUP raised as `Stopped`: after the cleanup
            click.echo(f"error: {exc if isinstance(exc, Stopped) else 'interrupted'}", err=True)
            sys.exit(128 + getattr(exc, "signum", signal.SIGINT))
    return stopping_cleanly(wrapper)


class ProgressBar:
    """A click progress bar over bytes, on stderr; `convert` calls start() then update()."""

    def __init__(self, label: str, enabled: bool = True):
        self.label, self.bar = label, None
        self.enabled = enabled and sys.stderr.isatty()  # no bar in logs and pipes

    def start(self, total: int) -> None:
        if self.enabled:
            self.bar = click.progressbar(length=total, label=self.label, file=sys.stderr, show_pos=False,
                                         show_percent=True, show_eta=True)
            self.bar.__enter__()

    def update(self, n: int) -> None:
        if self.bar:
            self.bar.update(n)

    def close(self) -> None:
        if self.bar:
            self.bar.__exit__(None, None, None)
            self.bar = None
