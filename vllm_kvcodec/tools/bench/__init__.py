"""Benchmarks: scripts that print figures and write JSON (never timed tests)."""
