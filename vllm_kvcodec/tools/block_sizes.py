"""Which vLLM block sizes a chunk size fits, for the commands that write a connector config.

The connector stores whole chunks, so ``chunk_size`` must be a multiple of the
engine's ``--block-size``, and the attention backend decides which block sizes
exist. The commands that build a config (``kvcodec config``, ``kvcodec
serve``) know no engine yet: they check against the block size the command
line gives (``kvcodec serve``: or vLLM's default on this platform), else
against the backends' rules and, when nothing fits, say what would.
"""

from __future__ import annotations

#: vLLM's CPU attention backend takes block sizes that are multiples of this
#: (``CPUAttentionBackend.get_supported_kernel_block_sizes``: ``MultipleOf(32)``; a test checks it).
CPU_BLOCK_MULTIPLE = 32
#: vLLM's CUDA backends (FlashAttention, Triton, FlashInfer) take multiples of 16.
CUDA_BLOCK_MULTIPLE = 16
#: vLLM's block size on its CPU backend when --block-size is not given (``CpuPlatform.check_and_update_config``;
#: a test checks it). MLA models get 16 there whatever is asked, and any multiple of 32 is a multiple of 16.
CPU_DEFAULT_BLOCK_SIZE = 128
_LARGEST_BLOCK = 256


def fitting_block_sizes(chunk_size: int, multiple: int) -> list[int]:
    """Block sizes of a backend (multiples of ``multiple``, up to 256) that divide ``chunk_size``."""
    return [b for b in range(multiple, min(chunk_size, _LARGEST_BLOCK) + 1, multiple) if chunk_size % b == 0]


def chunk_size_error(chunk_size: int) -> str | None:
    """None if a CPU or CUDA block size divides ``chunk_size``; else which block sizes there are and what fits."""
    if fitting_block_sizes(chunk_size, CUDA_BLOCK_MULTIPLE):
        return None
    return (f"chunk_size {chunk_size} fits no vLLM block size: it must be a multiple of the engine's --block-size, "
            f"which is a multiple of {CPU_BLOCK_MULTIPLE} on vLLM's CPU backend (32, 64, 128, ...) and of "
            f"{CUDA_BLOCK_MULTIPLE} on its CUDA backends; use e.g. {_nearest(chunk_size)}")


def platform_default_block_size() -> int | None:
    """vLLM's block size on this machine without --block-size, where the platform alone decides it (the CPU);
    None where the attention backend the model gets decides (CUDA: 16, or what its backends prefer)."""
    from vllm.platforms import current_platform

    return CPU_DEFAULT_BLOCK_SIZE if current_platform.is_cpu() else None


def chunk_size_note(chunk_size: int) -> str | None:
    """A note when ``chunk_size`` fits CUDA block sizes only (a CPU engine would refuse it at start-up)."""
    cuda = fitting_block_sizes(chunk_size, CUDA_BLOCK_MULTIPLE)
    if not cuda or fitting_block_sizes(chunk_size, CPU_BLOCK_MULTIPLE):
        return None
    return (f"note: chunk_size {chunk_size} fits --block-size {', '.join(map(str, cuda))} (CUDA) but no block size of "
            f"vLLM's CPU backend (multiples of {CPU_BLOCK_MULTIPLE}); on a CPU use e.g. {_nearest(chunk_size)}")


def _nearest(chunk_size: int) -> str:
    lower = chunk_size // CPU_BLOCK_MULTIPLE * CPU_BLOCK_MULTIPLE
    sizes = [c for c in (lower, lower + CPU_BLOCK_MULTIPLE) if c > 0]
    return f"chunk_size {' or '.join(map(str, sizes))} with --block-size {CPU_BLOCK_MULTIPLE}"
