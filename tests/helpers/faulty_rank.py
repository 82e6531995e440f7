"""`interop` under torchrun with one rank made to fail, for tests/cli/test_distributed.py.

INTEROP_TEST_SPLIT=1 lowers `--workers`' size threshold so that a tiny model splits, and prints
"workers: N" each time a rank starts N workers.

INTEROP_TEST_FAULT="raise:R" makes rank R raise an InteropError as it starts writing its units,
"kill:R" SIGKILLs it there, "hang:R" makes it wait there (for a Ctrl-C), "elsewhere:R" runs rank R from another directory (a relative SRC it does
not see); the arguments are `interop`'s.
"""
import os
import signal
import sys
import time

import interop.convert as conversion
import interop.workers as parallel
from interop.cli.main import main
from interop.errors import InteropError


def _patch() -> None:
    """The fault and the split, in this rank only (a worker re-imports this file as `__mp_main__`)."""
    if os.environ.get("INTEROP_TEST_SPLIT"):
        parallel.MIN_BYTES_PER_WORKER = 1
        real_run = parallel.run

        def counting(tasks, *args, **kwargs):
            print(f"workers: {len(tasks)}", flush=True)
            return real_run(tasks, *args, **kwargs)

        parallel.run = counting
    kind, _, rank = os.environ.get("INTEROP_TEST_FAULT", "none:-1").partition(":")
    if int(os.environ["RANK"]) == int(rank):
        if kind == "elsewhere":
            os.chdir("/")
        else:
            def failing(*args, **kwargs):
                time.sleep(0.5)  # the other ranks are mid-way
                if kind == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                if kind == "hang":
                    print("hanging", flush=True)
                    time.sleep(600)
                raise InteropError("injected fault")

            conversion.stream = conversion.write_units = failing


if __name__ == "__main__":
    _patch()
    sys.argv = ["interop", *sys.argv[1:]]
    main()
