#!/usr/bin/env python3
"""What one Prometheus scrape of fastdeploy_sync.metrics costs the engine's process:
``TaskQueue.stats()`` alone, and ``generate_latest()`` of a registry holding the collector
(one TaskQueue at TP=8, no workers), medians of 2000 calls. Prints numbers, asserts nothing.

    python scripts/benchmarks/bench_metrics_scrape.py
"""
import statistics
import time

from prometheus_client import CollectorRegistry, generate_latest

from fastdeploy_sync import TaskQueue
from fastdeploy_sync.metrics import register


def median_us(fn, n=2000):
    out = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        fn()
        out.append(time.perf_counter_ns() - t0)
    return statistics.median(out) / 1000


def main():
    with TaskQueue("scrapecost", 8) as queue:
        for i in range(5):
            queue.put_tasks(i, timeout=1)
        registry = CollectorRegistry()
        register(registry, queue)
        size = len(generate_latest(registry))
        print(f"stats() p50 {median_us(queue.stats):.1f} us; generate_latest() p50 "
              f"{median_us(lambda: generate_latest(registry)):.1f} us; {size} bytes per scrape "
              f"(TP=8, one queue)")


if __name__ == "__main__":
    main()
