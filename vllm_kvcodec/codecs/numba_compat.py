"""Make numba safe to import in a process that later starts a vLLM CPU worker.

vLLM's Triton kernel-override pass (``vllm/triton_utils/dispatcher.py``,
``_rebind_kernels``) calls ``vars()`` on every attribute of every loaded
module. llvmlite's ``binding.ffi.lib`` wraps any attribute it is asked for
lazily, including ``__dict__``, so the scan gets a function wrapper instead of
a dict and the worker dies with "'_lib_fn_wrapper' object has no attribute
'get'" whenever numba was imported first (our codecs, in a demo or a test that
starts a second engine). Answering ``__dict__`` with an empty dict is
harmless for llvmlite and lets the scan pass. Imported by every numba kernel
module before numba itself.
"""

from __future__ import annotations


def guard_llvmlite_for_vllm() -> None:
    try:
        from llvmlite.binding import ffi
    except ImportError:
        return
    fntab = getattr(getattr(ffi, "lib", None), "_fntab", None)
    if isinstance(fntab, dict):
        fntab.setdefault("__dict__", {})


guard_llvmlite_for_vllm()
