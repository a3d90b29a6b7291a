"""Type stub of the copy extension (``_copy.c``): its functions are reached through ctypes
(``ckptcache/format/fastcopy.py``); the module itself defines no Python names."""
