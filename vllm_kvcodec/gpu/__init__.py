"""GPU paths: SplitZip in Triton (:mod:`.splitzip_triton`) and NVDEC for the video codec (:mod:`.nvcodec`).

Nothing here is imported by the rest of the package, and importing this
package imports neither triton nor PyNvVideoCodec: each submodule loads what
it needs when it is imported (``splitzip_triton``: torch + triton) or called
(``nvcodec``: PyNvVideoCodec, lazily). See docs/gpu.md.
"""
