"""Prometheus metrics of one daemon (served on ``--metrics-port`` when set)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

__all__ = ["Metrics"]

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)


class Metrics:
    """All metric families, on a private registry (so several daemons in one test never clash)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.bytes_saved = Counter("ckptcache_saved_bytes", "Bytes committed by saves", registry=r)
        self.bytes_loaded = Counter(
            "ckptcache_loaded_bytes", "Bytes served to loads", ["tier"], registry=r
        )
        self.saves = Counter("ckptcache_saves", "Committed saves", registry=r)
        self.loads = Counter("ckptcache_loads", "Loads served", ["tier"], registry=r)
        self.save_latency = Histogram(
            "ckptcache_save_stall_seconds", "Trainer stall of a save (client-measured)",
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.load_latency = Histogram(
            "ckptcache_load_open_seconds", "Daemon time to serve a load's open request",
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.segments = Gauge("ckptcache_segments", "Segment files", registry=r)
        self.memory_used = Gauge(
            "ckptcache_memory_used_bytes", "Bytes of segment files", registry=r
        )
        self.memory_shared = Gauge(
            "ckptcache_memory_shared_bytes",
            "Bytes of older generations read from a newer generation's memory (not counted "
            "in memory_used)", registry=r,
        )  # fmt: skip
        self.memory_limit = Gauge("ckptcache_memory_limit_bytes", "Memory budget", registry=r)
        self.evictions = Counter("ckptcache_evictions", "Generations evicted", registry=r)
        self.budget_failures = Counter(
            "ckptcache_budget_failures", "Reserves that ran out of memory", registry=r
        )
        self.corrupt = Counter("ckptcache_corrupt", "Corrupt copies detected", ["tier"], registry=r)
        self.persist_bytes = Counter("ckptcache_persist_bytes", "Bytes persisted", registry=r)
        self.persist_bytes_reused = Counter(
            "ckptcache_persist_bytes_reused",
            "Bytes of persisted files copied from the previous file of the path, not written "
            "from memory (incremental_persist)",
            registry=r,
        )
        self.push_bytes_held = Counter(
            "ckptcache_push_bytes_held",
            "Bytes of backup copies pushed to peers that held them already, so not sent",
            registry=r,
        )
        self.fetch_bytes_held = Counter(
            "ckptcache_fetch_bytes_held",
            "Bytes of copies fetched from peers that this node held already, so not received",
            registry=r,
        )
        self.save_bytes_kept = Counter(
            "ckptcache_save_bytes_kept",
            "Bytes of saves left in place in the segment, unwritten since the save whose bytes "
            "it held, so not copied by the trainer",
            registry=r,
        )
        self.free_checks = Counter(
            "ckptcache_free_checks",
            "Freed segments hashed again before a save may keep their bytes, by result "
            "(equal: their token may be handed out; changed: their bytes are never kept)",
            ["result"],
            registry=r,
        )
        self.persist_errors = Counter(
            "ckptcache_persist_errors", "Persist attempts that failed", registry=r
        )
        self.unlisted_transitions = Counter(
            "ckptcache_unlisted_persist_transitions",
            "Persist-state changes the state table does not list (applied; a daemon bug)",
            registry=r,
        )
        self.persist_latency = Histogram(
            "ckptcache_persist_seconds", "Time to persist one object",
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.storage_reads = Counter(
            "ckptcache_storage_reads", "Objects read from storage into memory", registry=r
        )
        self.coordinator_requests = Counter(
            "ckptcache_coordinator_requests", "Requests to the coordinator", ["op"], registry=r
        )
        self.persist_queue = Gauge(
            "ckptcache_persist_queue", "Objects waiting to persist", registry=r
        )
        self.digest_queue = Gauge(
            "ckptcache_digest_queue",
            "Generations waiting for their digests and freed segments waiting for their check "
            "(or refill), in the background, the one in hand included",
            registry=r,
        )
        self.peer_clock_offset = Gauge(
            "ckptcache_peer_clock_offset_seconds",
            "A peer's wall clock minus this node's, as last measured", ["peer"], registry=r,
        )  # fmt: skip

    def serve(self, port: int, addr: str) -> int:
        """Start the HTTP endpoint; returns the bound port (useful with port 0)."""
        server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        return int(server.server_port)
