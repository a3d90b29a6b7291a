"""The memory a node holds: segments (``arena``, ``pool``, ``sealing``), the daemon's records
of them, the index of generations, and what leaves memory when (``eviction``, ``shares``,
``retention``, ``superseded``, ``staging``)."""
