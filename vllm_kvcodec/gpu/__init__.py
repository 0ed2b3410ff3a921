"""GPU kernels and device plumbing: SplitZip in Triton (:mod:`.splitzip_triton`), the paged scatter/gather
(:mod:`.scatter_triton`), NVDEC/NVENC for the video codec (:mod:`.nvcodec`), the side stream, pinned staging.

The load and save paths use them on CUDA engines (:mod:`vllm_kvcodec.load.cuda_placement`,
:mod:`vllm_kvcodec.save.cuda_gather`). Importing this package imports neither triton nor
PyNvVideoCodec: each submodule loads what it needs when it is imported (``splitzip_triton``:
torch + triton) or called (``nvcodec``: PyNvVideoCodec, lazily). See docs/gpu.md.
"""
