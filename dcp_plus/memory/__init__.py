"""Shared host memory: slabs and their registry, skipped (HSDP replica) views."""
