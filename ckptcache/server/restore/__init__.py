"""Loads and where their bytes come from: this node's memory (``loads``), a peer's
(``fetching``, ``remote_load``), the group's storage read (``storage_read``), and the
answers about what is held (``queries``)."""
