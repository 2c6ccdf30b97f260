"""Benchmarks against stock DCP and physical limits (run as ``python -m benchmarks.<name>``)."""
