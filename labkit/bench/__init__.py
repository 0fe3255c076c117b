"""Benchmarks: ``python -m labkit.bench {memory,sim,kernels,serve,http,disagg}``."""
