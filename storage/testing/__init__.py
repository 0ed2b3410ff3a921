"""Stores and servers for tests and benchmarks, not for serving: real Redis and Mooncake servers on free
loopback ports, an emulated network link (``link+``) and seeded fault injection (``faults+``)."""
