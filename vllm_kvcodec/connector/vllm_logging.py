"""The connector's log lines go where vLLM's go, at vLLM's level and in vLLM's format.

Why this is needed: vLLM configures only its own ``vllm`` logger (a handler on
stderr/stdout, ``VLLM_LOGGING_LEVEL``, ``propagate=False``; see
``vllm/logger.py``). The ``vllm_kvcodec`` logger is not under it, so under
``vllm serve`` its records reach the root logger, which has no handler:
Python's last-resort handler prints WARNING and above, and every INFO line
(the start-up line, the periodic ``kvcodec worker:`` / ``kvcodec scheduler:``
totals) is lost.

:func:`follow_vllm_logging` hands the ``vllm_kvcodec`` records to the ``vllm``
logger's handlers as they are at the time of each record, so whatever vLLM was
told (``VLLM_LOGGING_LEVEL``, ``VLLM_LOGGING_CONFIG_PATH``, its JSON format,
``VLLM_CONFIGURE_LOGGING=0``) applies to these lines too. A deployment that
configured ``vllm_kvcodec`` itself (a handler or a level of its own) is left
alone. :func:`refusal_logged` puts why the connector refuses to start into
that log, ahead of vLLM's traceback.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

from vllm_kvcodec.errors import ConfigError, KVCodecError

PACKAGE_LOGGER = "vllm_kvcodec"


class ToVllmHandler(logging.Handler):
    """Passes each record to the handlers of vLLM's logger (and on up, if vLLM's logging is off)."""

    def emit(self, record: logging.LogRecord) -> None:
        logging.getLogger("vllm").handle(record)


def follow_vllm_logging() -> None:
    """Route ``vllm_kvcodec`` records through vLLM's logging (idempotent; called in every vLLM process)."""
    ours = logging.getLogger(PACKAGE_LOGGER)
    if any(isinstance(h, ToVllmHandler) for h in ours.handlers):
        return
    if ours.handlers or ours.level != logging.NOTSET:
        return  # configured by the deployment: theirs to decide
    ours.addHandler(ToVllmHandler())
    ours.setLevel(logging.getLogger("vllm").getEffectiveLevel())
    ours.propagate = False  # as vLLM's own logger: one copy of each line, not a second via the root logger


@contextlib.contextmanager
def refusal_logged() -> Iterator[None]:
    """Log why the connector refuses to start, one ERROR line per problem, before the error goes on up.

    vLLM answers an exception in a connector's constructor with hundreds of
    lines of traceback from several processes; these lines, each with the
    cause and what to do, are the ones to find in it.
    """
    try:
        yield
    except KVCodecError as exc:
        if isinstance(exc, ConfigError) and exc.problems:
            lines = [f"{exc.heading}: {problem}" for problem in exc.problems]
        else:
            lines = [" ".join(str(exc).split())]
        for line in lines:
            logging.getLogger(PACKAGE_LOGGER).error("kvcodec: refusing to start: %s", line.removeprefix("kvcodec: "))
        raise
