"""One exception type for user mistakes: the CLI prints its message on one line and exits 2."""


class InteropError(Exception):
    """Bad input or an impossible request (a missing file, a layout that does not fit).

    Raise it with a message that names the file or value and what is wrong; bugs
    stay ordinary exceptions so that they keep their traceback.
    """


class RankStopped(Exception):
    """This rank of a distributed conversion stopped because another failed; that rank prints the error line,
    so the CLI exits non-zero without a word."""
