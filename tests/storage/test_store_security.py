"""Store security against a real redis-server: passwords, ACL users, TLS, and secrets kept out of logs.

The store is shared infrastructure: only the deployment's own credentials may
read or write it, a wrong credential must fail clearly (and count as a miss in
the connector, never hang), and no credential may reach a log line, an error
message or a repr.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from storage import StoreError, open_store
from tests.support.redis_server import short_lived_redis_server
from tests.storage.test_stores import _make_tls_files
from vllm_kvcodec.connector.config import ConnectorConfig
from vllm_kvcodec.errors import ConfigError
from vllm_kvcodec.format import decode_chunk, encode_chunk

pytestmark = pytest.mark.redis

PASSWORD = "pw-7Hq2-not-in-logs"
ACL = ["--user", "default", "off", "--user", "kvc", "on", f">{PASSWORD}", "~kvc/*", "+@all", "-@dangerous"]


def _no_secret(*texts: object) -> None:
    for text in texts:
        assert PASSWORD not in str(text), f"the password leaked into: {text}"


def test_requirepass_server_needs_the_password(real_chunks, caplog) -> None:
    caplog.set_level(logging.DEBUG)
    with short_lived_redis_server(["--requirepass", PASSWORD]) as server:
        with open_store(f"redis://:{PASSWORD}@127.0.0.1:{server.port}/0") as store:
            blob = encode_chunk(real_chunks[0])
            store.put("kvc/a", blob)
            assert decode_chunk(store.get("kvc/a")).equal(real_chunks[0])
            _no_secret(repr(store), store.url)
        for url in (f"redis://127.0.0.1:{server.port}/0", f"redis://:wrong-{PASSWORD[:3]}@127.0.0.1:{server.port}/0"):
            with open_store(url) as store, pytest.raises(StoreError, match=r"(?i)auth|NOAUTH|WRONGPASS") as info:
                store.get("kvc/a")
            _no_secret(info.value, info.value.__cause__)
    _no_secret(*(r.getMessage() for r in caplog.records))


def test_acl_user_is_confined_to_its_keys(real_chunks) -> None:
    with short_lived_redis_server(ACL) as server:
        base = f"redis://kvc:{PASSWORD}@127.0.0.1:{server.port}/0"
        blob = encode_chunk(real_chunks[1])
        with open_store(f"{base}?prefix=kvc/") as store:
            store.put_many([("x", blob), ("y", blob)])
            assert [decode_chunk(b).equal(real_chunks[1]) for b in store.get_many(["x", "y"])] == [True, True]
            assert sorted(store.keys("")) == ["x", "y"]
        with open_store(f"{base}?prefix=other/") as outside, pytest.raises(StoreError, match="NoPermission") as info:
            outside.put("x", blob)  # keys outside ~kvc/* are refused by the server
        _no_secret(info.value, info.value.__cause__, outside.url)
        with open_store(f"redis://default:{PASSWORD}@127.0.0.1:{server.port}/0") as off, pytest.raises(StoreError):
            off.get("kvc/x")  # the default user is disabled


def test_tls_with_password_and_verified_certificate(tmp_path: Path, real_chunks) -> None:
    tls = _make_tls_files(tmp_path)
    with short_lived_redis_server(["--requirepass", PASSWORD], tls_files=tls) as server:
        url = f"rediss://:{PASSWORD}@127.0.0.1:{server.port}/0?ssl_ca_certs={tls['ca']}"
        with open_store(url) as store:
            store.put("kvc/t", encode_chunk(real_chunks[2]))
            assert decode_chunk(store.get("kvc/t")).equal(real_chunks[2])
        plain = f"redis://:{PASSWORD}@127.0.0.1:{server.port}/0"
        with open_store(plain) as store, pytest.raises(StoreError) as info:
            store.get("kvc/t")  # a TLS-only port does not speak plain Redis
        _no_secret(info.value, info.value.__cause__)


def test_config_errors_never_echo_credentials() -> None:
    with pytest.raises(ConfigError) as info:
        ConnectorConfig.from_extra_config({"store": f"ftp://u:{PASSWORD}@host/x"})
    _no_secret(info.value)
    with pytest.raises(StoreError) as info:
        open_store(f"redis://u:{PASSWORD}@127.0.0.1:1/0?bogus=1&ssl_password={PASSWORD}")
    _no_secret(info.value)


def test_stored_bytes_are_never_unpickled_or_evaluated() -> None:
    """The decode path parses a fixed binary header; no pickle, eval or non-weights torch.load anywhere."""
    root = Path(__file__).resolve().parents[2]
    risky = re.compile(r"\bpickle\.loads?\(|\bmarshal\.loads?\(|(?<![\w.])eval\(|(?<![\w.])exec\(|torch\.load\((?![^)]*weights_only=True)")
    offenders = [
        f"{path.relative_to(root)}:{n}"
        for folder in ("vllm_kvcodec", "storage")
        for path in sorted((root / folder).rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if risky.search(line)
    ]
    assert not offenders, offenders
