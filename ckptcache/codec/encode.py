"""The one encode entry: an object planned for a segment, by the fastest encoder that applies.

The encoders, tried in this order; each one that does not apply hands the object to the next:

1. **A plan of the same structure** (:class:`~ckptcache.codec.plan.cache.PlanCache`): the
   skeleton and the archive plan of an earlier save reused, the integers that changed written
   in at their known places; a save pays a walk of its object and no pickling. A structure
   this process has not saved may take the plan the daemon keeps for it, from the segment of
   an earlier save (:mod:`~ckptcache.codec.plan.stored`), checked against its key.
2. **The skeleton written from that walk** (:func:`~ckptcache.codec.skeleton.
   encode_flattened`), with a tensor table (:func:`~ckptcache.codec.table.table.encode_table`):
   a plain structure of CPU tensors, byte for byte what the pickler writes.
3. **The pickler** (:func:`~ckptcache.codec.flatten.flatten`): every object ``torch.save``
   accepts.

Without a plan cache only 3 runs. :func:`~ckptcache.codec.objectio.write_object` then copies
the storages into the segment; :mod:`ckptcache.codec.decode` reads them back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ckptcache.codec.flatten import Flattened, flatten
from ckptcache.codec.objectio import plan_object
from ckptcache.codec.plan.cache import PlanCache
from ckptcache.codec.plan.stored import StoredPlan
from ckptcache.format.manifest import ObjectPlan

__all__ = ["encode"]


def encode(
    obj: Any,
    path: str,
    namespace: str,
    *,
    plans: PlanCache | None = None,
    versions: bool = True,
    stored: Callable[[bytes, str], StoredPlan | None] | None = None,
) -> tuple[Flattened, ObjectPlan]:
    """``obj`` flattened and its segment planned for ``path`` in ``namespace``, trying the
    encoders in the module's order; ``plans``: the saver's plans by structure (none: pickle);
    ``versions``: record the tensors' version counters (a non-blocking save's check);
    ``stored(key, path)``: the plan the daemon keeps for a structure ``plans`` has not met
    (:meth:`PlanCache.prepare`).

    Raises :class:`~ckptcache.errors.SerializationError` for values ``torch.save`` could not
    save either.
    """
    if plans is not None:
        return plans.prepare(obj, path, namespace, versions=versions, stored=stored)
    flat = flatten(obj)
    return flat, plan_object(flat, path, namespace)
