"""Launching this package's Triton kernels: compiled on CUDA, or in Triton's interpreter on CPU tensors.

The interpreter is how every kernel here is tested without a GPU. It is chosen
by ``TRITON_INTERPRET=1`` in the environment *before* triton is first imported
in the process (triton decorates its own library functions at import), so it
is a property of the process, not of a call: :func:`interpreted` reports it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
import triton

from vllm_kvcodec.errors import ConfigError

#: Triton's interpreter keeps the launch grid in process-wide state: one launch at a time
#: (the GPU fetcher launches from several I/O threads).
_INTERPRETER_LOCK = threading.Lock()


@triton.jit
def _probe(x_ptr):
    pass


def interpreted() -> bool:
    """True when Triton kernels run in the interpreter in this process (TRITON_INTERPRET=1 at import)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_probe, InterpretedFunction)


class Launcher:
    """Launches kernels on one device: CUDA compiled, or CPU tensors in the interpreter."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.interpret = interpreted()
        if device.type == "cpu" and not self.interpret:
            raise ConfigError(
                "these Triton kernels run on CUDA tensors; CPU tensors need Triton's interpreter "
                "(TRITON_INTERPRET=1 set before triton is first imported)"
            )
        if device.type not in ("cpu", "cuda"):
            raise ConfigError(f"these Triton kernels run on CUDA tensors, not {device}")

    def __call__(self, kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
        if self.interpret:
            kwargs.pop("num_warps", None)
            with _INTERPRETER_LOCK:
                kernel[grid](*args, **kwargs)
        else:
            with torch.cuda.device(self.device):
                kernel[grid](*args, **kwargs)


def can_run_on(device: torch.device | str) -> bool:
    """Whether the kernels can run on ``device`` in this process."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available()
    return device.type == "cpu" and interpreted()


def resolve_device(device: torch.device | str, current_cuda: Callable[[], int] | None = None) -> torch.device:
    """``device`` with its index filled in: ``cuda`` means the current CUDA device (``current_cuda()``).

    A tensor's ``.device`` always carries an index (``cuda:0``) while a caller
    may say ``"cuda"``; ``torch.device("cuda") != torch.device("cuda:0")``, so
    devices are compared only after this.
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", (current_cuda or torch.cuda.current_device)())
    return device


def same_device(a: torch.device | str, b: torch.device | str, current_cuda: Callable[[], int] | None = None) -> bool:
    """Whether ``a`` and ``b`` name one device (``cuda`` and ``cuda:N`` alike when N is the current one)."""
    return resolve_device(a, current_cuda) == resolve_device(b, current_cuda)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
