"""The errors every checkpoint reader and layout raises (all are ``ValueError``\\ s)."""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "MissingTensorError",
    "AmbiguousLayoutError",
    "IncompleteCheckpointError",
    "UnsafePathError",
    "NotARegularFileError",
]


class CheckpointError(ValueError):
    """A checkpoint (or a tensor in it) is unreadable, corrupt or not what the layout needs."""


class MissingTensorError(CheckpointError, KeyError):
    """A layer's tensors are not in the checkpoint; the message lists what was looked for."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class AmbiguousLayoutError(CheckpointError):
    """Unrecorded tensors whose shapes admit more than one (format, block); the message lists them.

    Attributes:
        candidates: the ``(format, block)`` pairs the shapes admit.
        argument: the keyword that picks one (``"block"`` or ``"format"``).
    """

    def __init__(self, message: str, candidates=(), argument: str = "block") -> None:
        super().__init__(message)
        self.candidates = tuple(candidates)
        self.argument = argument


class IncompleteCheckpointError(CheckpointError):
    """A sharded checkpoint that is missing parts: an index naming absent shards, or shards without their index."""


class UnsafePathError(CheckpointError):
    """An index names a file outside the checkpoint directory (absolute, ``..``, or a symlink out of it)."""


class NotARegularFileError(CheckpointError):
    """A checkpoint path is a FIFO, device, socket or directory where a regular file is needed (never opened)."""
