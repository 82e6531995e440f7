"""One exception type for user mistakes: the CLI prints its message on one line and exits 2."""


class InteropError(Exception):
    """Bad input or an impossible request (a missing file, a layout that does not fit).

    Raise it with a message that names the file or value and what is wrong; bugs
    stay ordinary exceptions so that they keep their traceback.
    """
