"""``python -m vllm_kvcodec.tools.bench codecs|stores|...``: the same commands as ``kvcodec bench``."""

from vllm_kvcodec.tools.cli import bench_app

if __name__ == "__main__":
    bench_app(prog_name="python -m vllm_kvcodec.tools.bench")
