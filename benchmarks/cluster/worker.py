"""A trainer process inside one lab node: loads one object when told to, reports when done.

    ip netns exec <node ns> python benchmarks/cluster/worker.py cache <socket> <url>
    ip netns exec <node ns> python benchmarks/cluster/worker.py direct <endpoint> <url>

Prints ``ready`` once imports are done, then waits for a line on stdin (the bench starts
every node's load at once that way), loads, and prints one JSON line: the wall-clock time it
finished (the bench subtracts the start it sent), the tier, the bytes loaded and the CPU
seconds the load took in this process.
"""

from __future__ import annotations

import io
import json
import sys
import time

import torch


def load_cache(socket: str, url: str) -> tuple[object, str]:
    """Through the node's daemon: local memory, a peer's, or storage once per group."""
    from ckptcache.client import Client

    with Client(socket, fallback="raise", timeout=600) as c:
        obj = c.load(url, mmap=False)  # a private copy, like the direct read's
        return obj, str(c.status(url).last_load_tier)


def load_direct(endpoint: str, url: str) -> tuple[object, str]:
    """What a trainer does without the cache: GET the whole object, ``torch.load`` it."""
    import boto3

    bucket, _, key = url.removeprefix("s3://").partition("/")
    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                      aws_access_key_id="lab", aws_secret_access_key="lab")  # fmt: skip
    data = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
    return torch.load(io.BytesIO(data), weights_only=True), "storage"


def main() -> None:
    mode, where, url = sys.argv[1:4]
    print("ready", flush=True)
    sys.stdin.readline()
    cpu0 = time.process_time()
    obj, tier = (load_cache if mode == "cache" else load_direct)(where, url)
    cpu = time.process_time() - cpu0
    nbytes = sum(t.numel() * t.element_size() for t in obj.values() if torch.is_tensor(t))
    print(json.dumps({"end": time.time(), "tier": tier, "nbytes": nbytes, "cpu": cpu}), flush=True)


if __name__ == "__main__":
    main()
