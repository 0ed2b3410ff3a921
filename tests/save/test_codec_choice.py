"""codec "auto": raw on a fast link, the densest codec on a slow one, from measured figures."""

from __future__ import annotations

from vllm_kvcodec.save.codec_choice import CodecChooser


def feed(chooser: CodecChooser, gbps: float, nbytes: int = 8 << 20, rtt: float = 0.0) -> None:
    """A window's worth of reads one after another, on a clock of their own (their times, not the test's)."""
    end = feed.clock = getattr(feed, "clock", 0.0) + 1000.0
    for _ in range(40):
        seconds = rtt + nbytes * 8 / (gbps * 1e9)
        end += seconds
        chooser.observe_read(nbytes, seconds, end=end)


def test_auto_follows_the_link(real_chunks) -> None:
    chooser = CodecChooser("auto")
    sample = real_chunks[0][:5]
    feed(chooser, 0.5)
    slow = chooser.codec_for(sample)
    assert slow.codec_id == max(chooser.profile, key=lambda c: chooser.profile[c]["ratio"])
    feed(chooser, 10_000)
    # On a link this fast only decode speed counts: the fastest measured decoder wins (raw, unless
    # the machine was busy while raw's 3 timed decodes ran; comparing with a fixed name is a flaky timing test).
    fastest = max(chooser.profile, key=lambda c: chooser.profile[c]["decode_Bps"])
    assert chooser.codec_for(sample).codec_id == fastest
    assert abs(chooser.bandwidth_bytes_per_s * 8 / 1e9 - 10_000) / 10_000 < 0.01


def pin_raw_and_zstd(chooser: CodecChooser, sample) -> None:
    """Calibrate, then pin the figures (the decision under test, not this machine's timing): raw 8 GB/s; zstd
    1.5x at 3 GB/s; every other candidate out of the running."""
    chooser.codec_for(sample)
    p = chooser.profile
    p["raw"] = {"ratio": 1.0, "decode_Bps": 8e9}
    p["zstd"] = {"ratio": 1.5, "decode_Bps": 3e9}
    for other in set(p) - {"raw", "zstd"}:
        p[other] = {"ratio": 1.1, "decode_Bps": 1e8}


def test_reads_that_cost_cpu_add_to_the_decode(real_chunks) -> None:
    """A link where overlapping the stages favours a codec, and adding them (a local file store) favours raw."""
    chooser = CodecChooser("auto")
    sample = real_chunks[0][:5]
    pin_raw_and_zstd(chooser, sample)
    feed(chooser, 16.0)  # 2 GB/s: raw reads in 0.5 s/GB; zstd in 0.33 s/GB, decodes in 0.33 s/GB
    assert chooser.codec_for(sample).codec_id == "zstd"
    chooser.reads_cost_cpu = True  # 0.5 + 0.125 s/GB against 0.33 + 0.33
    assert chooser.codec_for(sample).codec_id == "raw"


def test_decoding_beside_a_cpu_prefill_costs_its_thread_seconds(real_chunks) -> None:
    """Two decoders on a CPU engine whose prefill takes every core: each decoded byte's thread-time comes off the
    prefill whichever thread decodes it, so the decoder count no longer divides it."""
    chooser = CodecChooser("auto", decoders=2)
    sample = real_chunks[0][:5]
    pin_raw_and_zstd(chooser, sample)
    feed(chooser, 16.0)  # 2 GB/s: raw reads in 0.5 s/GB; zstd in 0.33 s/GB, decodes in 0.33 s/GB on one thread
    assert chooser.codec_for(sample).codec_id == "zstd"  # overlapped: 0.5 against max(0.33, 0.17)
    chooser.reads_cost_cpu = True
    assert chooser.codec_for(sample).codec_id == "zstd"  # added, two decoders: 0.56 against 0.5
    chooser.decode_takes_prefill_cores = True
    assert chooser.codec_for(sample).codec_id == "raw"  # thread-seconds: 0.625 against 0.67
    feed(chooser, 1.0)  # a slow link: the wire dominates again
    assert chooser.codec_for(sample).codec_id == "zstd"


def test_fixed_codec_is_never_replaced(real_chunks) -> None:
    chooser = CodecChooser({"id": "zstd", "level": 3})
    feed(chooser, 10_000)
    assert chooser.codec_for(real_chunks[0][:5]).get_config() == {"id": "zstd", "level": 3}
    assert chooser.profile == {}


def test_small_transfers_do_not_pose_as_bandwidth() -> None:
    chooser = CodecChooser("auto", initial_gbps=10)
    before = chooser.bandwidth_bytes_per_s
    chooser.observe_read(100, 1.0)
    assert chooser.bandwidth_bytes_per_s == before


def test_latency_does_not_pose_as_a_slow_link() -> None:
    """10 ms of round trip on a 10 Gbit/s link: 3.9 MB reads take 13 ms; net of the round trip they say 10 Gbit/s."""
    chooser = CodecChooser("auto", initial_gbps=10)
    nbytes, rtt = 3_900_000, 0.010
    chooser.observe_round_trip(0.012)
    chooser.observe_round_trip(rtt)  # the least seen is the latency
    chooser.observe_round_trip(0.011)
    feed(chooser, 10, nbytes, rtt)
    assert abs(chooser.bandwidth_bytes_per_s * 8 / 1e9 - 10) < 0.01
    blind = CodecChooser("auto", initial_gbps=10)
    feed(blind, 10, nbytes, rtt)
    assert blind.bandwidth_bytes_per_s * 8 / 1e9 < 2.5  # what auto believed before


def test_concurrent_reads_add_up_to_the_link() -> None:
    """Four fetch threads sharing a 100 Gbit/s link: each 8 MiB read takes 4x its wire time, together they move
    100 Gbit/s. Read one by one they said 25 Gbit/s."""
    chooser = CodecChooser("auto", initial_gbps=1)
    wire = (8 << 20) * 8 / 100e9
    for batch in range(8):
        start = 50.0 + batch * 4 * wire
        for thread in range(4):  # started together, served one after another on the shared link
            chooser.observe_read(8 << 20, (thread + 1) * wire, end=start + (thread + 1) * wire)
    assert abs(chooser.bandwidth_bytes_per_s * 8 / 1e9 - 100) < 0.5


def test_reads_overrule_writes() -> None:
    """A saving instance's puts (a file store writing pages) run below its reads; once a read is seen,
    only reads count."""
    chooser = CodecChooser("auto", initial_gbps=10)
    chooser.observe_write(8 << 20, (8 << 20) * 8 / 2e9, end=10.0)
    assert abs(chooser.bandwidth_bytes_per_s * 8 / 1e9 - 2) < 0.01  # writes are all it knows: better than nothing
    feed(chooser, 40)
    chooser.observe_write(8 << 20, (8 << 20) * 8 / 2e9)
    assert abs(chooser.bandwidth_bytes_per_s * 8 / 1e9 - 40) < 0.01


def test_device_decode_paths_are_calibrated_and_weighed_as_the_fetcher_runs_them(real_chunks) -> None:
    """A CUDA engine's fetcher decodes splitzip on the device: auto times that path (not the CPU decode), counts
    its own parallelism, and never charges a device decode to the CPU prefill's cores."""
    from vllm_kvcodec.save.codec_choice import DecodePath, expected_seconds_per_byte
    from vllm_kvcodec.format import decode_chunk

    calls: list[int] = []

    def device_like(blob: bytes) -> None:  # a real decode, counted: what the chooser timed
        calls.append(len(blob))
        decode_chunk(blob)

    chooser = CodecChooser("auto", candidates=("raw", "splitzip"), decoders=2)
    chooser.decode_paths = {"splitzip": DecodePath(device_like, 1, "cuda:0 (Triton)")}
    sample = real_chunks[0][:5]
    chooser.codec_for(sample)
    assert len(calls) == 4  # one untimed, three timed
    assert chooser.profile["splitzip"]["on_cpu"] is False and chooser.profile["splitzip"]["parallel"] == 1
    assert "parallel" not in chooser.profile["raw"]  # the CPU path takes the decoder count when it decides
    # Pin the figures: raw decodes at 8 GB/s on the CPU, splitzip (1.33x) at 2000 GB/s on the device.
    chooser.profile["raw"].update(decode_Bps=8e9)
    chooser.profile["splitzip"].update(ratio=1.33, decode_Bps=2e12)
    feed(chooser, 400.0)  # 50 GB/s: the ratio pays, the device decode hides under the read
    chooser.decode_takes_prefill_cores = True  # would charge a CPU decode; a device decode is not charged
    assert chooser.codec_for(sample).codec_id == "splitzip"
    link = 50e9
    cpu = expected_seconds_per_byte(1.33, 2e12, link, 1, on_cpu=True, reads_cost_cpu=False, decode_takes_prefill_cores=True)
    dev = expected_seconds_per_byte(1.33, 2e12, link, 1, on_cpu=False, reads_cost_cpu=False, decode_takes_prefill_cores=True)
    assert dev == 1 / (1.33 * link) < cpu
    assert expected_seconds_per_byte(1.0, 1e9, 1e12, 4, on_cpu=True, reads_cost_cpu=False,
                                     decode_takes_prefill_cores=False) == 1 / 4e9  # decode-bound: 4 threads share it
