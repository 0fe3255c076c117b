"""Benchmarks: ``python -m labkit.bench {memory,sim,kernels,step,serve,http,disagg}``."""
