"""``mooncake://MASTER_HOST[:PORT]?options``: what a Mooncake store URL may say, parsed and checked.

The defaults follow ``mooncake_master``'s own: RPC port 50051, the master's
built-in HTTP metadata server on port 8080, its admin (metrics) server on 9003.
A client contributes no memory unless ``segment`` says so: the pool is the
memory of the processes that mount segments (``mooncake_client`` nodes, or
engines opened with ``segment=``); a client without one reads and writes theirs.
"""

from __future__ import annotations

import dataclasses
import socket
from urllib.parse import urlsplit

from storage.base import validate_prefix
from storage.errors import StoreURLError
from storage.options import parse_float, parse_int, parse_size, redact_url, reject_unknown, split_query

DEFAULT_MASTER_PORT = 50051
DEFAULT_METADATA_PORT = 8080
DEFAULT_ADMIN_PORT = 9003
DEFAULT_BUFFER = 256 << 20
DEFAULT_TIMEOUT_S = 5.0
PROTOCOLS = ("tcp", "rdma")
KNOWN = {"metadata", "admin", "protocol", "device", "local_host", "segment", "buffer", "replicas", "prefix", "timeout_s"}


@dataclasses.dataclass(frozen=True)
class MooncakeOptions:
    master: str  # host:port of the master's RPC service
    metadata: str  # the transfer engine's metadata server: http://host:port/metadata, etcd://..., P2PHANDSHAKE
    admin: str  # http://host:port of the master's admin server (listing keys)
    local_host: str  # the address other clients reach this one at
    protocol: str = "tcp"
    device: str = ""  # RDMA device names, for protocol=rdma
    segment: int = 0  # bytes of this process's memory mounted into the pool
    buffer: int = DEFAULT_BUFFER  # bytes of registered memory for transfers in flight (each direction)
    replicas: int = 1
    prefix: str = ""
    timeout_s: float = DEFAULT_TIMEOUT_S

    @property
    def master_host(self) -> str:
        return self.master.rsplit(":", 1)[0]

    @property
    def master_port(self) -> int:
        return int(self.master.rsplit(":", 1)[1])


def parse_mooncake_url(url: str) -> MooncakeOptions:
    """Options from ``url``; raises StoreURLError naming the option and the accepted forms."""
    options = _checked(url)
    if options.local_host:
        return options
    return dataclasses.replace(options, local_host=_route_to(options.master_host, options.master_port))


def check_url(url: str) -> None:
    """Refuse what :func:`parse_mooncake_url` would refuse, without resolving or reaching any host."""
    _checked(url)


def _checked(url: str) -> MooncakeOptions:
    """The options ``url`` gives, checked; ``local_host`` empty unless given (finding it needs a route)."""
    base, options = split_query(url)
    reject_unknown(options, KNOWN, url)
    host, port = _master(base, url)
    protocol = options.get("protocol", "tcp")
    if protocol not in PROTOCOLS:
        raise StoreURLError(f"option protocol={protocol!r} in {redact_url(url)} is not one of {', '.join(PROTOCOLS)}")
    return MooncakeOptions(
        master=f"{host}:{port}",
        metadata=options.get("metadata") or f"http://{host}:{DEFAULT_METADATA_PORT}/metadata",
        admin=(options.get("admin") or f"http://{host}:{DEFAULT_ADMIN_PORT}").rstrip("/"),
        local_host=options.get("local_host", ""),
        protocol=protocol,
        device=options.get("device", ""),
        segment=_size_or_zero("segment", options.get("segment", "0")),
        buffer=parse_size("buffer", options["buffer"]) if "buffer" in options else DEFAULT_BUFFER,
        replicas=parse_int("replicas", options.get("replicas", "1"), minimum=1),
        prefix=validate_prefix(options.get("prefix", "")),
        timeout_s=parse_float("timeout_s", options.get("timeout_s", str(DEFAULT_TIMEOUT_S)), minimum=0.001),
    )


def _master(base: str, url: str) -> tuple[str, int]:
    try:
        parts = urlsplit(base)
        host, port = parts.hostname, parts.port or DEFAULT_MASTER_PORT
    except ValueError as exc:
        raise StoreURLError(f"{redact_url(url)}: {exc}") from None
    if not host or parts.path not in ("", "/"):
        raise StoreURLError(f"{redact_url(url)} must name the master as mooncake://host:port (no path)")
    return host, port


def _size_or_zero(name: str, text: str) -> int:
    return 0 if text.strip() == "0" else parse_size(name, text)


def _route_to(host: str, port: int) -> str:
    """The local address this machine would use to reach ``host``: what other nodes can reach us at.

    A UDP ``connect`` only picks a route; no packet is sent.
    """
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, port))
            return probe.getsockname()[0]
    except OSError:
        return socket.gethostname()
