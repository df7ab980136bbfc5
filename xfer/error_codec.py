"""Errors on the wire: an exception travels as its class name and message, and comes back as
the same :class:`~xfer.errors.XferError` subclass. One codec for the control channel's replies
(``{"ok": False, "error": name, "message": text}``), the UCX transport's REFUSE and CANCEL
frames, and NVSHMEM's control replies.

A name this side does not know (or one that is not an XferError) decodes as
:class:`~xfer.errors.TransportError`: a peer can never make this side raise anything else.
"""

from __future__ import annotations

from . import errors
from .errors import XferError

__all__ = ["encode", "error_class", "decode", "reply_error", "error_reply"]


def encode(exc: BaseException) -> tuple[str, str]:
    """(name, message) of ``exc`` for a peer: an XferError keeps its class; anything else is this
    side's bug, sent as a plain ``XferError`` with its repr (a parser that meets malformed input
    raises, or wraps it in, :class:`~xfer.errors.InvalidArgumentError`)."""
    if isinstance(exc, XferError):
        return type(exc).__name__, str(exc)
    return XferError.__name__, repr(exc)


def error_class(name) -> type[XferError]:
    """The XferError subclass ``name`` names, else TransportError."""
    cls = getattr(errors, name, None) if isinstance(name, str) and name in errors.__all__ else None
    return cls if isinstance(cls, type) and issubclass(cls, XferError) else errors.TransportError


def decode(name, message, context: str) -> XferError:
    """The exception a peer sent, its message prefixed with ``context`` (who said it, about what)."""
    return error_class(name)(f"{context}: {message}")


def error_reply(exc: BaseException) -> dict:
    """A control reply refusing a request with ``exc``."""
    name, message = encode(exc)
    return {"ok": False, "error": name, "message": message}


def reply_error(reply: dict, peer: str) -> XferError | None:
    """The typed exception an error reply from ``peer`` carries (None for ``ok``)."""
    if reply.get("ok"):
        return None
    return decode(reply.get("error"), reply.get("message", "(no message)"), f"peer {peer!r} refused")
