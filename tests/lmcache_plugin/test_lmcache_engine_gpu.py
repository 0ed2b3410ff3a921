"""LMCache + the kvcodec plug-in inside a real vLLM engine (needs an NVIDIA GPU and the CUDA vLLM build).

LMCache's vLLM connector has no CPU path ("No supported cpu connector found"),
so this is the only engine-level check of the plug-in; tests/lmcache_plugin/test_lmcache_plugin.py
covers the plug-in itself through LMCache's storage stack on the CPU.

Two fresh engine processes share one file store: the first computes a long
prompt and LMCache saves its chunks through the plug-in; the second must load
them back through the plug-in (hits counted by the connector, no put of the
same chunks) and answer with the same greedy tokens.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.engine]

if not torch.cuda.is_available():
    pytest.skip("needs an NVIDIA GPU (LMCache's vLLM connector has no CPU path)", allow_module_level=True)

pytest.importorskip("lmcache")
pytest.importorskip("vllm")

CHUNK = 256

RUN = textwrap.dedent(
    """
    import gc, json, sys
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm_kvcodec.tools.smollm2 import model_dir, sample_token_ids

    if __name__ == "__main__":
        prompt = sample_token_ids(int(sys.argv[1]))
        llm = LLM(
            model=str(model_dir()),
            dtype="bfloat16",
            enforce_eager=True,
            max_model_len=4096,
            gpu_memory_utilization=0.3,
            enable_prefix_caching=False,  # every prefix hit must come from LMCache
            kv_transfer_config=KVTransferConfig(kv_connector="LMCacheConnectorV1", kv_role="kv_both"),
        )
        out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=16))
        tokens = list(out[0].outputs[0].token_ids)
        from vllm_kvcodec.lmcache_plugin import KVCodecRemoteConnector
        conns = [o for o in gc.get_objects() if isinstance(o, KVCodecRemoteConnector)]
        stats = [vars(c.stats) for c in conns]
        print("RESULT " + json.dumps({"tokens": tokens, "stats": stats}), flush=True)
    """
)


def _run_engine(script: Path, env: dict[str, str], num_tokens: int) -> dict:
    proc = subprocess.run([sys.executable, str(script), str(num_tokens)], env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def test_second_engine_loads_prefix_through_the_plugin(tmp_path: Path) -> None:
    store = tmp_path / "store"
    config = tmp_path / "lmcache.yaml"
    config.write_text(textwrap.dedent(f"""
        chunk_size: {CHUNK}
        local_cpu: false
        max_local_cpu_size: 2
        remote_serde: naive
        remote_storage_plugins: ["kvcodec"]
        extra_config:
          remote_storage_plugin.kvcodec.module_path: vllm_kvcodec.lmcache_plugin
          remote_storage_plugin.kvcodec.class_name: KVCodecConnectorAdapter
          remote_storage_plugin.kvcodec.store: "file://{store}"
          remote_storage_plugin.kvcodec.codec: rans
    """))
    script = tmp_path / "run_engine.py"
    script.write_text(RUN)
    env = {
        **os.environ,
        "LMCACHE_CONFIG_FILE": str(config),
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the worker (and the plug-in) live in the script's process
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": str(Path(__file__).resolve().parents[2]) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    num_tokens = 4 * CHUNK + 100

    cold = _run_engine(script, env, num_tokens)
    cold_puts = sum(s["puts"] for s in cold["stats"])
    assert cold_puts >= 4, cold["stats"]

    from storage import open_store
    from vllm_kvcodec.lmcache_plugin import envelope
    from vllm_kvcodec.lmcache_plugin.store_keys import ROOT, group_binding
    from vllm_kvcodec.format import read_header

    with open_store(f"file://{store}") as s:
        chunk_keys = [k for k in s.keys(ROOT) if not k.endswith("/ns")]
        assert len(chunk_keys) >= 4
        fmt, blobs = envelope.unpack(s.get(chunk_keys[0]))
        assert fmt == "KV_2LTD" and read_header(blobs[0], key=group_binding(chunk_keys[0], 0)).codec_id == "rans"

    warm = _run_engine(script, env, num_tokens)
    hits = sum(s["hits"] for s in warm["stats"])
    unusable = sum(s["unusable"] for s in warm["stats"])
    assert hits >= 4 and unusable == 0, warm["stats"]
    # bf16: loading a prefix instead of computing it can move the numerics a little;
    # greedy tokens of this prompt agree in practice, and a difference here is worth a look.
    assert warm["tokens"] == cold["tokens"]
