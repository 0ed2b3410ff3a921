"""Where generated artefacts (the converted model, real-KV samples, the default store) live.

Outside git, shared by tests, benchmarks and the demo; override with
``KVCODEC_CACHE_DIR``.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir(*parts: str) -> Path:
    root = Path(os.environ.get("KVCODEC_CACHE_DIR") or Path.home() / ".cache" / "vllm-kvcodec")
    path = root.joinpath(*parts)
    path.mkdir(parents=True, exist_ok=True)
    return path
