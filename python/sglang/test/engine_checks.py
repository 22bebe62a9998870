"""Assertions the engine tests share."""

from __future__ import annotations

import time


def assert_no_kv_leak(engine, timeout_s: float = 10.0) -> dict:
    """Once the engine is idle: free KV slots + slots held by the radix cache == pool size.

    Waits (up to timeout_s) for in-flight requests to drain first. Returns the server info.
    Raises AssertionError with the counts when slots leaked.
    """
    deadline = time.time() + timeout_s
    while True:
        info = engine.get_server_info()
        idle = info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0
        if idle or time.time() > deadline:
            break
        time.sleep(0.05)
    assert idle, f"engine not idle: {info['num_running_reqs']} running"
    free, held, size = info["kv_available_tokens"], info["radix_cache_tokens"], info["kv_pool_size"]
    assert free + held == size, f"KV leak: free {free} + radix {held} != pool {size}"
    return info
