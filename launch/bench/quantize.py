"""Benchmark: encode/decode throughput of the all-reduce wire formats on this CPU.

The int8 path must not be the bottleneck of a 1 Gbit/s link: that link carries 125 MB/s of int8
payload, i.e. 484 MB/s of fp32 pseudo-gradient in each direction, and each byte is encoded once per
phase and decoded once per peer chunk. Prints fp32-GB/s per format and thread count, and the ratio to
what a 1 Gbit/s link needs.

    python launch/bench/quantize.py [--mb 256] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from elastic_mesh.wire.codecs import BLOCK, codec_for

LINK_BYTES_PER_S = 1e9 / 8


def measure(codec, x: torch.Tensor, repeats: int) -> tuple[float, float, float]:
    encode, decode = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        wire = codec.encode(x)
        t1 = time.perf_counter()
        y = codec.decode(wire, x.numel())
        t2 = time.perf_counter()
        encode.append(t1 - t0)
        decode.append(t2 - t1)
    error = ((y - x).norm() / x.norm()).item()
    return x.numel() * 4 / statistics.median(encode) / 1e9, x.numel() * 4 / statistics.median(decode) / 1e9, error


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="example: python launch/bench/quantize.py --mb 256")
    parser.add_argument("--mb", type=int, default=256, help="fp32 megabytes per measurement")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    n = args.mb * 2**20 // 4 // BLOCK * BLOCK
    x = torch.randn(n)
    print(f"{args.mb} MB of fp32 Gaussian values, median of {args.repeats}")
    for threads in sorted({1, torch.get_num_threads()}):
        torch.set_num_threads(threads)
        for name in ("int8", "bf16"):
            codec = codec_for(name)
            enc, dec, err = measure(codec, x, args.repeats)
            # fp32 GB/s a 1 Gbit/s link needs of this codec: link rate / wire bytes per fp32 byte
            needed = LINK_BYTES_PER_S / (codec.bytes_per_value / 4) / 1e9
            print(f"{name:5s} {threads} thread(s): encode {enc:5.2f} GB/s, decode {dec:5.2f} GB/s, "
                  f"wire {codec.bytes_per_value / 4:.3f} of fp32, rel. error {err * 100:.2f}%, "
                  f"encode / 1 Gbit/s need = {enc / needed:.1f}x")


if __name__ == "__main__":
    main()
