"""Parsing store URL query options, and keeping passwords out of logs.

Store configuration travels as one URL string (a CLI flag, a vLLM
``kv_connector_extra_config`` entry), so every option is a query parameter and
every parse error names the option and the accepted forms.
"""

from __future__ import annotations

import difflib
import re
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from storage.errors import StoreURLError

_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?(?:e[0-9]+)?)\s*((?:[kmgtp]i?)?b?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "p": 10**15}
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def parse_size(name: str, text: str) -> int:
    """Bytes from ``10GiB``, ``500MB``, ``64k``, ``1e9`` (SI units powers of 1000, ``i`` units of 1024)."""
    match = _SIZE.match(text)
    if not match:
        raise StoreURLError(f"option {name}={text!r} is not a size such as 10GiB, 500MB or 1e9")
    number, unit = float(match.group(1)), match.group(2).lower().removesuffix("b")
    scale = 1024 ** ("kmgtp".index(unit[0]) + 1) if unit.endswith("i") else _UNITS[unit]
    size = int(number * scale)
    if size <= 0:
        raise StoreURLError(f"option {name}={text!r} must be a positive size")
    return size


def parse_bool(name: str, text: str) -> bool:
    value = text.strip().lower()
    if value in _TRUE | _FALSE:
        return value in _TRUE
    raise StoreURLError(f"option {name}={text!r} is not a boolean (1/0, true/false, yes/no, on/off)")


def parse_float(name: str, text: str, *, minimum: float = 0.0) -> float:
    try:
        value = float(text)
    except ValueError:
        raise StoreURLError(f"option {name}={text!r} is not a number") from None
    if not value >= minimum or value == float("inf"):
        raise StoreURLError(f"option {name}={text!r} must be a finite number >= {minimum}")
    return value


def parse_int(name: str, text: str, *, minimum: int = 0) -> int:
    try:
        value = int(text)
    except ValueError:
        raise StoreURLError(f"option {name}={text!r} is not an integer") from None
    if value < minimum:
        raise StoreURLError(f"option {name}={text!r} must be >= {minimum}")
    return value


def split_query(url: str) -> tuple[str, dict[str, str]]:
    """The URL without its query, and the query as a dict (repeated options are an error)."""
    base, _, query = url.partition("?")  # not urlsplit: it would rewrite file:relative as file:///relative
    options: dict[str, str] = {}
    for name, value in parse_qsl(query, keep_blank_values=True):
        if name in options:
            raise StoreURLError(f"option {name!r} is given twice in {redact_url(url)}")
        options[name] = value
    return base, options


def with_query(base: str, options: dict[str, str]) -> str:
    """``base`` (a URL without a query) with ``options`` as its query."""
    return f"{base}?{urlencode(options)}" if options else base


def reject_unknown(options: dict[str, str], known: set[str], url: str) -> None:
    """A misspelled option is an error naming the nearest known one, never an option silently ignored."""
    unknown = sorted(set(options) - known)
    if unknown:
        guesses = [g for name in unknown for g in difflib.get_close_matches(name, known, n=1)]
        hint = f"did you mean {', '.join(guesses)}? " if guesses else ""
        raise StoreURLError(
            f"unknown option(s) {', '.join(unknown)} in {redact_url(url)}; {hint}known: {', '.join(sorted(known)) or 'none'}"
        )


_SECRET_OPTIONS = re.compile(r"(?i)([?&](?:password|ssl_password)=)[^&#]*")
# A URL inside an option (Mooncake's metadata=redis://:pw@host, etcd://user:pw@host), raw or percent-encoded.
_NESTED_USERINFO = re.compile(r"(?i)(=[a-z][a-z0-9+.-]*(?:://|%3A%2F%2F)[^:@/?&#%]*(?::|%3A))[^@/?&#]*(?=@|%40)")


def redact_url(url: str) -> str:
    """``url`` with any password (userinfo, a ``password``/``ssl_password`` option, or the userinfo of a
    URL given as an option) as ``***``, for logs and errors."""
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:
        return "<unparsable URL>"
    if password:
        userinfo, _, hostinfo = parts.netloc.rpartition("@")
        user = userinfo.split(":", 1)[0]
        url = urlunsplit(parts._replace(netloc=f"{user}:***@{hostinfo}"))
    return _NESTED_USERINFO.sub(r"\1***", _SECRET_OPTIONS.sub(r"\1***", url))
