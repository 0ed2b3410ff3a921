"""A third-party codec, installed as its own distribution, is found by its id as numcodecs finds its plug-ins.

The plug-in is a real distribution on ``sys.path`` (a package and its
``.dist-info`` with an ``entry_points.txt`` naming the codec in the
``vllm_kvcodec.codecs`` group, what ``pip install`` writes), used from fresh
interpreters: one that has it encodes and decodes a chunk whose header names it
without importing it, one that lacks it refuses that chunk by name.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PLUGIN = '''
import numpy as np

from vllm_kvcodec.codecs.base import Codec


class ByteSwapCodec(Codec):
    """A toy plug-in: each element's bytes reversed (lossless, any dtype)."""

    codec_id = "byteswap_plugin"

    def encode(self, bits, dtype):
        return np.ascontiguousarray(bits).byteswap().tobytes()

    def decode(self, payload, dtype, shape):
        n = int(np.prod(shape))
        if len(payload) != n * dtype.itemsize:
            from vllm_kvcodec.errors import CodecError
            raise CodecError("byteswap_plugin: payload size")
        return np.frombuffer(payload, dtype=dtype.bits_dtype, count=n).byteswap().reshape(shape)
'''


def installed(root: Path, target: str = "kvc_byteswap.codec:ByteSwapCodec") -> Path:
    """``root`` holding the plug-in's package and the dist-info pip would write for it."""
    (root / "kvc_byteswap").mkdir(parents=True)
    (root / "kvc_byteswap" / "__init__.py").write_text("")
    (root / "kvc_byteswap" / "codec.py").write_text(PLUGIN)
    info = root / "kvc_byteswap-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvc-byteswap\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[vllm_kvcodec.codecs]\nbyteswap_plugin = {target}\n")
    return root


def run(code: str, *paths: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*map(str, paths), os.getcwd()]))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=300)


ENCODE = """
    import sys, torch
    from vllm_kvcodec.codecs import codec_ids
    from vllm_kvcodec.format import decode_chunk, encode_chunk, read_header
    assert "byteswap_plugin" in codec_ids()
    assert "kvc_byteswap" not in sys.modules  # offered, not imported until a chunk or a config names it
    kv = (torch.randn(2, 2, 16, 2, 8) * 3).to(torch.bfloat16)
    blob = encode_chunk(kv, codec="byteswap_plugin")
    assert read_header(blob).codec_id == "byteswap_plugin"
    assert torch.equal(decode_chunk(blob).view(torch.int16), kv.view(torch.int16))
    open("{out}", "wb").write(blob)
"""


def test_a_plug_in_codec_encodes_and_its_chunks_decode_where_it_is_installed(tmp_path) -> None:
    site = installed(tmp_path / "site")
    blob = tmp_path / "chunk.bin"
    done = run(ENCODE.format(out=blob), site)
    assert done.returncode == 0, done.stderr
    decode = f"""
        import sys
        from vllm_kvcodec.format import decode_chunk
        decode_chunk(open("{blob}", "rb").read())
        assert "kvc_byteswap" in sys.modules  # imported by the header's codec id
    """
    again = run(decode, site)
    assert again.returncode == 0, again.stderr
    missing = run(f"""
        from vllm_kvcodec.errors import ChunkFormatError
        from vllm_kvcodec.format import decode_chunk
        try:
            decode_chunk(open("{blob}", "rb").read())
        except ChunkFormatError as exc:
            print(exc)
        else:
            raise SystemExit("decoded without the plug-in")
    """)
    assert missing.returncode == 0, missing.stderr
    assert "unknown codec 'byteswap_plugin'" in missing.stdout


def test_a_connector_config_may_name_an_installed_plug_in_codec(tmp_path) -> None:
    site = installed(tmp_path / "site")
    code = """
        from vllm_kvcodec.connector.config import ConnectorConfig
        print(ConnectorConfig.from_extra_config({"codec": "byteswap_plugin"}).codec)
    """
    assert run(code, site).stdout.strip() == "byteswap_plugin"
    refused = run(code)
    assert refused.returncode != 0 and "unknown codec 'byteswap_plugin'" in refused.stderr


@pytest.mark.parametrize("target,why", [("kvc_byteswap.nowhere:ByteSwapCodec", "failed to import"),
                                        ("kvc_byteswap.codec:np", "is not a Codec subclass")])
def test_a_broken_plug_in_is_refused_by_name(tmp_path, target: str, why: str) -> None:
    site = installed(tmp_path / "site", target)
    done = run("""
        from vllm_kvcodec.codecs import get_codec
        from vllm_kvcodec.errors import ConfigError
        try:
            get_codec("byteswap_plugin")
        except ConfigError as exc:
            print(exc)
    """, site)
    assert done.returncode == 0, done.stderr
    assert "codec 'byteswap_plugin'" in done.stdout and why in done.stdout
