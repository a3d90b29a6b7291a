"""Save plans reused across saves of the same structure: the cache (``cache``), the walk that
reads a state dict's tensors in columns (``columns``) and the objects whose pickling it can
predict (``reduced``)."""
