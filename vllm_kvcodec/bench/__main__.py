"""``python -m vllm_kvcodec.bench codecs|stores|...``: the same commands as ``kvcodec bench``."""

from vllm_kvcodec.cli import bench_app

if __name__ == "__main__":
    bench_app(prog_name="python -m vllm_kvcodec.bench")
