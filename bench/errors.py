"""xfer-bench's exit codes and its one error type (the CLI prints the message, exits with the code)."""

from __future__ import annotations

import enum

__all__ = ["Exit", "BenchError"]


class Exit(enum.IntEnum):
    OK = 0
    ERROR = 1  # anything else (an unexpected xfer error: the message names it)
    USAGE = 2  # bad flags or flag values (argparse uses 2 as well)
    UNREACHABLE = 3  # the peer or its store cannot be reached, or stopped answering
    UNVERIFIED = 4  # destination bytes differ from the source
    NO_TRANSPORT = 5  # no requested transport can serve the pair


class BenchError(Exception):
    """A failure the user can act on; ``code`` is the process exit status."""

    def __init__(self, message: str, code: Exit = Exit.ERROR):
        super().__init__(message)
        self.code = Exit(code)
