"""The exception hierarchy: one root, and each error also subclasses the built-in a caller catches.

Every message says what happened and what to do about it.
"""

from __future__ import annotations

import pickle

__all__ = [
    "BudgetExceeded",
    "CannotPersist",
    "CheckpointDeleted",
    "CheckpointNotFound",
    "CkptCacheError",
    "CkptCacheWarning",
    "ConfigError",
    "CoordinatorUnavailable",
    "CorruptCheckpoint",
    "DaemonUnavailable",
    "InvalidPath",
    "NameTooLong",
    "NewestUnavailable",
    "ObjectTooLarge",
    "ParentNotADirectory",
    "PathIsADirectory",
    "PathNotAllowed",
    "PersistConflict",
    "PersistError",
    "PersistTimeout",
    "ProtocolMismatch",
    "ReplicationError",
    "RequestTooLarge",
    "SerializationError",
    "StateMismatch",
    "TensorMutated",
    "UnsafeUnpickle",
]


class CkptCacheError(Exception):
    """Root of every error ckptcache raises."""


class CkptCacheWarning(UserWarning):
    """Warnings ckptcache emits (write-through fallbacks, degraded modes)."""


class CheckpointNotFound(CkptCacheError, FileNotFoundError):
    """No tier (memory, peers, storage) holds the requested path."""


class DaemonUnavailable(CkptCacheError, ConnectionError):
    """The local cache daemon cannot be reached or went away mid-call."""


class ProtocolMismatch(CkptCacheError, RuntimeError):
    """Client and daemon speak different protocol versions, or a segment has an unknown layout."""


class BudgetExceeded(CkptCacheError, MemoryError):
    """The daemon's memory budget cannot fit the request within the wait timeout."""


class ObjectTooLarge(BudgetExceeded):
    """The object is larger than the whole memory budget: it can never be cached."""


class CorruptCheckpoint(CkptCacheError, ValueError):
    """Stored bytes do not match their recorded digest, or a segment/file is truncated."""

    def __init__(self, message: str, *, tensor: str | None = None, tier: str | None = None):
        super().__init__(message)
        #: Name of the first tensor (state-dict key path) whose digest did not match, if known.
        self.tensor = tensor
        #: The tier where the bad copy was found ("local", "peer", "storage").
        self.tier = tier


class StateMismatch(CkptCacheError, ValueError):
    """A checkpoint's tensors do not fit the tensors a load was asked to fill (a tensor missing,
    or of another shape or dtype); nothing was written."""

    def __init__(self, message: str, *, tensor: str):
        super().__init__(message)
        #: The key path of the first tensor that does not fit.
        self.tensor = tensor


class SerializationError(CkptCacheError, TypeError):
    """The object cannot be flattened (an unpicklable non-tensor value, mixed-dtype storage)."""


class UnsafeUnpickle(CkptCacheError, pickle.UnpicklingError):
    """``weights_only=True`` refused a global that is not on the allowlist."""


class InvalidPath(CkptCacheError, ValueError, TypeError):
    """The checkpoint path is of the wrong type or malformed."""


class PathNotAllowed(CkptCacheError, PermissionError):
    """The path lies outside every configured storage root."""


class CannotPersist(CkptCacheError, OSError):
    """The path could never be written (a ``torch.save`` to it would fail the same way): the
    save is refused before any byte is copied."""


class PathIsADirectory(CannotPersist, IsADirectoryError):
    """The checkpoint path names an existing directory."""


class ParentNotADirectory(CannotPersist, NotADirectoryError):
    """A parent of the checkpoint path is a file."""


class NameTooLong(CannotPersist):
    """A component of the checkpoint path is longer than the file system allows."""


class RequestTooLarge(ProtocolMismatch):
    """A request to the daemon exceeded its size cap."""


class ConfigError(CkptCacheError, ValueError):
    """A configuration file, flag or environment variable is invalid."""


class PersistError(CkptCacheError, OSError):
    """Persisting to storage failed after all retries; the in-memory copy is kept."""


class CheckpointDeleted(PersistError):
    """The directory the checkpoint was saved into was removed before it was persisted:
    ckptcache treats it as deleted by the user and never recreates the directory."""


class PersistConflict(PersistError):
    """Another ckptcache writer (a save of the same path on another node) replaced the stored
    object after this save was made, and only wall clocks could tell which is newer: neither
    was overwritten. Save again to make one the newest."""


class ReplicationError(CkptCacheError, ConnectionError):
    """A backup copy could not be made (``durability="backup"``); the local copy is kept."""


class PersistTimeout(CkptCacheError, TimeoutError):
    """``wait`` gave up before the object was persisted (it may still be persisted later)."""


class TensorMutated(CkptCacheError, RuntimeError):
    """A tensor of a non-blocking save was modified before its copy finished: the save was
    aborted (the previous generation stays) rather than storing torn bytes."""


class CoordinatorUnavailable(CkptCacheError, ConnectionError):
    """The cluster's coordinator (etcd) cannot be reached, so other nodes' memory cannot be
    searched: a path this node does not hold may still exist there, and one it holds may have
    been saved again elsewhere. Retry when it is back."""


class NewestUnavailable(CkptCacheError, ConnectionError):
    """The newest save of a path (made on another node) is in no reachable node's memory and
    not on storage: an older copy exists, but is not returned in its place. Retry once that
    node is back, or load a specific older checkpoint knowingly."""
