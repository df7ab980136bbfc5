"""The ``ucx`` transport package (see :mod:`.transport`); importing it does not import ucxx."""

from .transport import UcxTransport

__all__ = ["UcxTransport"]
