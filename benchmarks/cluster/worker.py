"""A trainer process inside one lab node: loads one object when told to, reports when done.

    ip netns exec <node ns> python benchmarks/cluster/worker.py cache <socket> <url>
    ip netns exec <node ns> python benchmarks/cluster/worker.py cache-copy <socket> <url>
    ip netns exec <node ns> python benchmarks/cluster/worker.py direct <endpoint> <url>

Before it prints ``ready`` it does what a trainer does while it starts, before it loads: the
imports, and for the cache its client's warm-up (``Client.warmup(wait=True)``: connect, map the
daemon's spare segments for the first save). Then it waits for a line on stdin (the bench
starts every node's load at once that way), loads, reads every byte of every tensor (what a
copy to the GPU does; a zero-copy load has not touched its pages before), and prints one JSON
line: the wall-clock times its load returned and it finished (the bench subtracts the start
it sent), the tier, the bytes loaded and the CPU seconds the load took in this process.

``cache`` loads with the defaults: tensors laid over the daemon's segment (zero-copy);
``cache-copy`` with ``mmap=False``, a private heap copy. Either way the daemon checked every
byte it brought in from storage or a peer against its digests before it committed the copy.
"""

from __future__ import annotations

import io
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

Loader = Callable[[], tuple[Any, Callable[[], str]]]


def cache_loader(socket: str, url: str, copy: bool) -> Loader:
    """A warmed-up client of the node's daemon, and the load to run on the start line (the
    tier it came from is asked after the times are taken: not part of the load)."""
    from ckptcache.client import Client
    from ckptcache.codec import objectio  # noqa: F401 - what the first load imports

    client = Client(socket, fallback="raise", timeout=600)
    client.warmup(wait=True)

    def load() -> tuple[Any, Callable[[], str]]:
        obj = client.load(url, mmap=False) if copy else client.load(url)

        def tier() -> str:
            with client:
                return str(client.status(url).last_load_tier)

        return obj, tier

    return load


def direct_loader(endpoint: str, url: str) -> Loader:
    """What a trainer does without the cache: GET the whole object, ``torch.load`` it."""
    import boto3

    bucket, _, key = url.removeprefix("s3://").partition("/")
    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                      aws_access_key_id="lab", aws_secret_access_key="lab")  # fmt: skip

    def load() -> tuple[Any, Callable[[], str]]:
        data = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
        return torch.load(io.BytesIO(data), weights_only=True), lambda: "storage"

    return load


def main() -> None:
    mode, where, url = sys.argv[1:4]
    torch.set_num_threads(1)  # eight trainers share the lab's two cores
    if mode == "direct":
        load = direct_loader(where, url)
    else:
        load = cache_loader(where, url, copy=mode == "cache-copy")
    print("ready", flush=True)
    sys.stdin.readline()
    cpu0 = time.process_time()
    obj, tier = load()
    loaded = time.time()
    tensors = [t for t in obj.values() if torch.is_tensor(t)]
    for t in tensors:  # every byte read once, as a copy to the device would
        t.sum()
    cpu = time.process_time() - cpu0
    end = time.time()
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    print(json.dumps({"loaded": loaded, "end": end, "tier": tier(), "nbytes": nbytes,
                      "cpu": cpu}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
