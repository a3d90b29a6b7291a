"""Framework adapters: turn the cache on in an existing training script with one line.

Each submodule imports its framework, so import only the one you use:

* ``ckptcache.adapters.deepspeed``: ``enable()`` once per process (every engine built later
  uses the cache; per-engine options in the DeepSpeed config), or ``enable(engine)``.
* ``ckptcache.adapters.megatron``: ``CacheSaveShardedStrategy`` / ``CacheLoadShardedStrategy``
  for ``dist_checkpointing``; ``enable()`` for Megatron-LM's legacy ``torch.save`` path.
* ``ckptcache.adapters.dcp``: ``CacheWriter`` / ``CacheReader`` for
  ``torch.distributed.checkpoint`` (also the stager of ``dcp.async_save``); ``enable()`` for
  ``checkpoint_id=``-only calls.
* ``ckptcache.adapters.lightning``: the ``CkptCacheIO`` plugin.

The files written are the framework's own (names, layout, marker files), so switching the
cache off, or reading the checkpoint with the framework's tools, keeps working. By default
(``commit_waits="files"``; ``$CKPTCACHE_COMMIT_WAITS`` changes it) the framework's save returns
once those files exist and hold the save, so its tools read them right away; where the
framework has an asynchronous protocol (DeepSpeed's decoupled engines, ``dcp.async_save``,
Lightning's ``AsyncCheckpointIO``) that wait runs off the training loop. Adapters use only the
public client API.
"""

__all__: list[str] = []
