"""Type stub of the pass's extension (``_pagescan.c``): its functions are reached through ctypes
(``ckptcache/client/_watch.py``); the module itself defines no Python names."""
