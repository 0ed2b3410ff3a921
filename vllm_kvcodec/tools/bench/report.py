"""What every benchmark shares: the machine it ran on, JSON output, a rich table."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

console = Console(stderr=False)


def machine() -> dict[str, Any]:
    import torch

    return {
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
        **_cpu_model(),
        "cores": os.cpu_count(),
        "load_average": list(os.getloadavg()),
        "torch": torch.__version__,
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _cpu_model() -> dict[str, Any]:
    """The processor's name and its AMX flags: figures differ between the AMX Xeons and the EPYCs these run on."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    names = [line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")]
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    return {"cpu_model": names[0] if names else None, "amx": sorted(f for f in set(flags) if f.startswith("amx"))}


def write_json(result: dict[str, Any], output: Path | None) -> None:
    if output is None:
        return
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2) + "\n")
    console.print(f"[dim]wrote {output}[/dim]")


def table(title: str, columns: list[str], rows: list[list[Any]]) -> None:
    t = Table(title=title)
    for c in columns:
        t.add_column(c, justify="left" if c == columns[0] else "right")
    for r in rows:
        t.add_row(*[f"{v:.3f}" if isinstance(v, float) and abs(v) < 10 else f"{v:.0f}" if isinstance(v, float) else str(v) for v in r])
    console.print(t)


def wide_table(title: str, columns: list[str], rows: list[list[str]], width: int = 110) -> None:
    """Figures in columns that a pipe or a log file does not truncate (at least ``width`` columns wide)."""
    from rich import box

    t = Table(title=title, box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False)
    for c in columns:
        t.add_column(c, justify="left" if c == columns[0] else "right", no_wrap=True)
    for r in rows:
        t.add_row(*r)
    # At least 110 columns: a pipe's default 80 would truncate the figures.
    Console(width=max(console.width, width), force_terminal=console.is_terminal).print(t)
