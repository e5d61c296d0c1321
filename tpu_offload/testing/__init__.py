"""Harnesses for tests, demos and benchmarks (importing this package imports nothing)."""
