"""Checkpointless recovery: healthy data-parallel replicas hand their state to ranks that lost it.

Typical use (every rank of a replica group, after a fault; see :class:`PeerRecovery`)::

    guard = StepGuard()
    recovery = PeerRecovery(replica_group, guard=guard)
    result = recovery.recover(model, optimizer, scheduler=sched, recovering=lost_my_state,
                              fallback=lambda: ckptcache.load(path))
    start_step = result.step
"""

from ckptcache.recovery._feasibility import Feasibility
from ckptcache.recovery._guard import StepGuard
from ckptcache.recovery._peer import PeerRecovery, RecoveryResult
from ckptcache.recovery._rng import RngState, capture_rng, restore_rng
from ckptcache.recovery._snapshot import HostMemoryStorage, HostSnapshot, SnapshotStorage
from ckptcache.recovery._state import training_state_dict
from ckptcache.recovery.errors import RecoveryError

__all__ = [
    "Feasibility",
    "HostMemoryStorage",
    "HostSnapshot",
    "PeerRecovery",
    "RecoveryError",
    "RecoveryResult",
    "RngState",
    "SnapshotStorage",
    "StepGuard",
    "capture_rng",
    "restore_rng",
    "training_state_dict",
]
