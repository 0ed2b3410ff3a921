"""GPU kernels and device plumbing: SplitZip in Triton (:mod:`.splitzip_triton`), the paged scatter/gather
(:mod:`.scatter_triton`), NVDEC/NVENC for the video codec (:mod:`.nvcodec`, :mod:`.nvdec_sessions`), the join and
the value digest kernels, the side stream, pinned staging.

Device plumbing only: nothing here imports the chunk format or a codec (what reads chunks for these kernels is
:mod:`vllm_kvcodec.format.device_chunks`, one level up; tests/gpu/test_gpu_imports.py holds this). The load and save paths
use them on CUDA engines (:mod:`vllm_kvcodec.load.cuda_placement`, :mod:`vllm_kvcodec.save.cuda_gather`).
Importing this package imports neither triton nor PyNvVideoCodec: each submodule loads what it needs when it is
imported (``splitzip_triton``: torch + triton) or called (``nvcodec``: PyNvVideoCodec, lazily). See docs/gpu.md.
"""
