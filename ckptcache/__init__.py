"""ckptcache: tiered in-memory checkpoint storage for PyTorch training.

Replace ``torch.save``/``torch.load`` with :func:`save`/:func:`load`; see README.md.
"""

__version__ = "0.1.0"

from ckptcache._async import SaveHandle
from ckptcache.api import delete, exists, load, prefetch, save, status, wait, warmup
from ckptcache.client import Client
from ckptcache.errors import (
    BudgetExceeded,
    CheckpointNotFound,
    CkptCacheError,
    CkptCacheWarning,
    ConfigError,
    CorruptCheckpoint,
    DaemonUnavailable,
    InvalidPath,
    ObjectTooLarge,
    PathNotAllowed,
    PersistError,
    PersistTimeout,
    ProtocolMismatch,
    SerializationError,
    TensorMutated,
    UnsafeUnpickle,
)
from ckptcache.wire.messages import ObjectInfo as ObjectStatus

__all__ = [
    "BudgetExceeded",
    "CheckpointNotFound",
    "CkptCacheError",
    "CkptCacheWarning",
    "Client",
    "ConfigError",
    "CorruptCheckpoint",
    "DaemonUnavailable",
    "InvalidPath",
    "ObjectStatus",
    "ObjectTooLarge",
    "PathNotAllowed",
    "PersistError",
    "PersistTimeout",
    "ProtocolMismatch",
    "SaveHandle",
    "SerializationError",
    "TensorMutated",
    "UnsafeUnpickle",
    "__version__",
    "delete",
    "exists",
    "load",
    "prefetch",
    "save",
    "status",
    "wait",
    "warmup",
]
