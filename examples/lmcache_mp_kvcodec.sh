#!/usr/bin/env bash
# LMCache multiprocess (MP) server with vllm-kvcodec's lossless serdes, and a vLLM that uses it.
#
#   pip install 'vllm-kvcodec[lmcache,redis]'
#
# See docs/lmcache.md ("LMCache MP mode") for every setting, the ratio each codec gives and
# which adapter reads which serde mode back. Pick ONE of the three servers below.
set -euo pipefail

case "${1:-kvcodec-redis}" in
  kvcodec-redis)
    # vllm-kvcodec's own L2 adapter over Redis (any store URL: redis://, rediss://, redis+cluster://,
    # mooncake://, file:///). LMCache imports vllm_kvcodec.lmcache_mp for this adapter, which also
    # registers the kvcodec serdes, so plain `lmcache server` works. Objects take only their compressed bytes.
    exec lmcache server --port 5555 --l1-size-gb 20 --eviction-policy LRU --chunk-size 256 \
      --l2-adapter '{"type": "plugin", "module_path": "vllm_kvcodec.lmcache_mp", "class_name": "KVCodecL2Adapter", "adapter_params": {"store": "redis://localhost:6379/0"}, "serde": {"type": "kvcodec-rans", "max_workers": 2}}'
    ;;
  lmcache-fs)
    # LMCache's own fs adapter with a kvcodec serde. LMCache 0.5.6's fs adapter reads back only objects
    # of the serde's full size estimate, so use fixed_ratio (every object ceil(raw / 1.3) bytes; one that
    # does not compress that well is not stored). Start through our launcher: it registers the serdes
    # and then runs `lmcache server` with these arguments unchanged.
    exec python -m vllm_kvcodec.lmcache_mp.server --port 5555 --l1-size-gb 20 --eviction-policy LRU --chunk-size 256 \
      --l2-adapter '{"type": "fs", "base_path": "/var/cache/lmcache", "serde": {"type": "kvcodec-zstd", "fixed_ratio": 1.3}}'
    ;;
  lmcache-mooncake)
    # LMCache's own Mooncake Store adapter (needs LMCache built with its native Mooncake extension) with a
    # kvcodec serde, fixed_ratio as for fs. Not run in this project's CI: the PyPI lmcache 0.5.6 wheel lacks
    # lmcache.lmcache_mooncake. Our adapter over mooncake:// (first case, another URL) needs no extension.
    exec python -m vllm_kvcodec.lmcache_mp.server --port 5555 --l1-size-gb 20 --eviction-policy LRU --chunk-size 256 \
      --l2-adapter '{"type": "mooncake_store", "metadata_server": "P2PHANDSHAKE", "master_server_address": "mooncake-master:50051", "protocol": "tcp", "global_segment_size": "4GB", "local_buffer_size": "1GB", "serde": {"type": "kvcodec-rans", "fixed_ratio": 1.3}}'
    ;;
  *)
    echo "usage: $0 [kvcodec-redis|lmcache-fs|lmcache-mooncake]" >&2
    exit 2
    ;;
esac

# Then, in another shell, vLLM (GPU) talks to the server with LMCache's MP connector:
#   vllm serve <model> --kv-transfer-config '{"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
#     "kv_connector_extra_config": {"lmcache.mp.host": "tcp://localhost", "lmcache.mp.port": 5555}}'
