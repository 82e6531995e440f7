"""`interop` under torchrun with one rank made to fail, for tests/cli/test_distributed.py.

INTEROP_TEST_FAULT="raise:R" makes rank R raise an InteropError as it starts writing its units,
"kill:R" SIGKILLs it there, "hang:R" makes it wait there (for a Ctrl-C), "elsewhere:R" runs rank R from another directory (a relative SRC it does
not see); the arguments are `interop`'s.
"""
import os
import signal
import sys
import time

import interop.convert as conversion
from interop.cli.main import main
from interop.errors import InteropError

kind, _, rank = os.environ["INTEROP_TEST_FAULT"].partition(":")
if int(os.environ["RANK"]) == int(rank):
    if kind == "elsewhere":
        os.chdir("/")
    else:
        real = conversion.stream

        def failing(*args, **kwargs):
            time.sleep(0.5)  # the other ranks are mid-way
            if kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if kind == "hang":
                print("hanging", flush=True)
                time.sleep(600)
            raise InteropError("injected fault")

        conversion.stream = failing
sys.argv = ["interop", *sys.argv[1:]]
main()
