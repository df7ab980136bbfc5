"""Keep a command's stdout for its own output (a table, a JSON document) while libraries print.

C and C++ libraries write to file descriptor 1 directly, past ``sys.stdout``: Gloo prints
``[Gloo] Rank 1 is connected to 1 peer ranks...`` whenever a process group forms (torch 2.10
does), in this process or in any child it starts. Under ``xfer-bench --json`` that line used to
land before the JSON document. :func:`own_stdout` points fd 1 (and ``sys.stdout``) at stderr
for its duration and hands back a stream on the original stdout for the command's own output.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from collections.abc import Iterator
from typing import TextIO


@contextlib.contextmanager
def own_stdout() -> Iterator[TextIO]:
    """Yield a text stream on the original stdout; meanwhile fd 1 and ``sys.stdout`` go to stderr.

    Child processes started inside inherit the redirected fd 1. Where ``sys.stdout`` is not fd 1
    (pytest's capsys, a StringIO) it is yielded as is, and only fd 1 is redirected.
    """
    real = sys.stdout
    try:
        real.flush()
        real_fd = real.fileno()
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        real_fd = None
    saved = os.dup(1)
    os.dup2(2, 1)
    out = real
    if real_fd == 1:
        out = open(saved, "w", buffering=1, encoding=real.encoding, errors=real.errors, closefd=False)
    sys.stdout = sys.stderr
    try:
        yield out
    finally:
        try:
            if out is real:
                out.flush()
            else:
                out.close()  # flushes; the fd stays open (closefd=False)
        finally:
            sys.stdout = real
            os.dup2(saved, 1)
            os.close(saved)
