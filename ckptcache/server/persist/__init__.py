"""Phase 2: the persister and its states, the digests it checks, the roots it may write
under, the safe write itself, and what a save recorded so a restart decides as it did
(``lineage``, ``provenance``)."""
