"""minickpt — a small, durable, verified checkpoint library for JAX.

The reference implementation of the course "Checkpointing in JAX". Every module is one
concept of the course; the labs rebuild its pieces.
"""

from .asynchronous import AsyncCheckpointer
from .checkpointer import Checkpointer, CheckpointMetadata, SaveStats, VerifyReport
from .errors import (
    CheckpointCorruptedError,
    CheckpointNotFoundError,
    CheckpointTooLargeError,
    FormatVersionError,
    MiniCkptError,
    MultiHostError,
    PeerTimeoutError,
    ProcessDisagreementError,
    StepAlreadyExistsError,
    StructureMismatchError,
    UnsafeCheckpointError,
    UnsupportedLeafError,
)
from .fallback import Restored
from .legacy import restore_checkpoint, save_checkpoint
from .manager import CheckpointManager
from .multihost.save import MultiHostOptions
from .options import CheckpointManagerOptions
from .tree import HostKey
from .version import __version__

__all__ = [
    "AsyncCheckpointer",
    "CheckpointCorruptedError",
    "CheckpointManager",
    "CheckpointManagerOptions",
    "CheckpointMetadata",
    "CheckpointNotFoundError",
    "CheckpointTooLargeError",
    "Checkpointer",
    "FormatVersionError",
    "HostKey",
    "MiniCkptError",
    "MultiHostError",
    "MultiHostOptions",
    "PeerTimeoutError",
    "ProcessDisagreementError",
    "Restored",
    "SaveStats",
    "StepAlreadyExistsError",
    "StructureMismatchError",
    "UnsafeCheckpointError",
    "UnsupportedLeafError",
    "VerifyReport",
    "__version__",
    "restore_checkpoint",
    "save_checkpoint",
]
