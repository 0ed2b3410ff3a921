"""``python -m vllm_kvcodec.lmcache_mp.server ARGS``: LMCache's ``lmcache server ARGS``, with the kvcodec serdes registered.

For servers whose L2 adapters are all LMCache's own (``fs``, ``mooncake_store``, ...):
LMCache imports third-party code only through a ``plugin`` adapter's ``module_path``,
so without our adapter in the list nothing would register ``kvcodec-*`` before
LMCache builds the serdes. This entry point registers them through LMCache's
``register_serde_factory`` and hands every argument, unchanged, to LMCache's own CLI.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> None:
    from lmcache.cli.main import main as lmcache_main

    import vllm_kvcodec.lmcache_mp  # noqa: F401  (registers the serdes)

    lmcache_main(["server", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    main()
