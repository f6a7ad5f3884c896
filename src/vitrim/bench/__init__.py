"""Benchmarks: attention backends, model throughput, latency, FLOPs and memory."""
