"""The ``nvshmem`` transport package (see :mod:`.transport`); importing it does not import nvshmem4py."""

from .transport import NvshmemTransport

__all__ = ["NvshmemTransport"]
