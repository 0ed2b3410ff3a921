"""Tooling around the product, never imported by it: the ``kvcodec`` CLI, the demo, benchmarks, store inspection,
fuzzing, the real-KV builder (SmolLM2) and the GPU self-checks."""
