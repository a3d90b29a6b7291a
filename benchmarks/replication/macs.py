"""Per-core throughput of the MACs the data plane could tag records with, in one run.

    python benchmarks/replication/macs.py --size 256MiB

Each candidate over the same faulted-in buffer in 4 MiB records (the data plane's bulk record),
on this thread, best of ``--rounds``: GiB/s per core and CPU-seconds per GiB (``thread_time``).
Poly1305 twice: through ``cryptography`` (which holds the interpreter lock) and through the
record extension (system OpenSSL, the lock released); the extension's one pass of Poly1305 and
xxh3 together (what a receiver runs per record); xxh3 alone for the digest every hop checks.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import os
import time
from collections.abc import Callable

import xxhash
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.poly1305 import Poly1305

from ckptcache._units import parse_bytes
from ckptcache.server.cluster.dataplane import TAG_IMPLEMENTATION, Xxh3
from ckptcache.server.cluster.dataplane._tagging import tag, tag_and_hash

RECORD = 4 << 20
KEY = os.urandom(32)
_STATE = Xxh3()


def _gmac(key: bytes) -> Callable[[memoryview], bytes]:
    def run(part: memoryview) -> bytes:
        enc = Cipher(algorithms.AES(key), modes.GCM(b"\0" * 12)).encryptor()
        enc.authenticate_additional_data(part)
        enc.finalize()
        return enc.tag

    return run


CANDIDATES: list[tuple[str, Callable[[memoryview], object]]] = [
    ("Poly1305 (cryptography, lock held)", lambda p: Poly1305.generate_tag(KEY, p)),
    (f"Poly1305 (record extension: {TAG_IMPLEMENTATION})", lambda p: tag(KEY, b"head", p)),
    ("AES-128-GMAC (cryptography; payload as associated data)", _gmac(KEY[:16])),
    ("AES-256-GMAC (cryptography; payload as associated data)", _gmac(KEY)),
    ("HMAC-SHA256 (OpenSSL, SHA-NI where present)", lambda p: hmac.digest(KEY, p, "sha256")),
    ("keyed BLAKE2b", lambda p: hashlib.blake2b(p, key=KEY).digest()),
    ("xxh3-64 (the digest; not a MAC)", xxhash.xxh3_64_intdigest),
    (
        "Poly1305 + xxh3 in one pass (record extension; a receiver's record)",
        lambda p: tag_and_hash(KEY, b"head", p, [(0, len(p), True)], _STATE),
    ),
]


def measure(buf: memoryview, fn: Callable[[memoryview], object], rounds: int) -> float:
    """Best CPU-seconds per GiB of ``fn`` over ``buf`` in records."""
    best = float("inf")
    for _ in range(rounds):
        t0 = time.thread_time()
        for start in range(0, len(buf), RECORD):
            fn(buf[start : start + RECORD])
        best = min(best, time.thread_time() - t0)
    return best / (len(buf) / (1 << 30))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="256MiB")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    buf = memoryview(bytearray(os.urandom(parse_bytes(args.size))))
    print(f"| MAC ({args.size}, 4 MiB records, best of {args.rounds}, {os.cpu_count()} cores, "
          f"load average {os.getloadavg()[0]:.1f}) | GiB/s per core | CPU-s/GiB |")  # fmt: skip
    print("|---|---:|---:|")
    for name, fn in CANDIDATES:
        cpu = measure(buf, fn, args.rounds)
        print(f"| {name} | {1 / cpu:.2f} | {cpu:.3f} |", flush=True)


if __name__ == "__main__":
    main()
