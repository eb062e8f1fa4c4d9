"""What checking the checksums costs: the data cache of a WikiText-103-sized corpus, read with and
without checking the CRC-32s torch.save wrote into it, and CRC-32 against SHA-256 per GB.
Prints a table; asserts nothing.

    python benchmarks/bench_checksums.py                  # 103M training tokens, ~0.8 GB cache
    python benchmarks/bench_checksums.py --tokens 10000000  # smaller, for a laptop with little RAM

The corpus is synthetic (random ids below 32768, WikiText-103's default vocabulary cap) with
WikiText-103's split sizes; the file is written by the course's own cache code (utils/data.py)
into --dir (default: a temporary folder), read back --repeat times, the fastest of each kept
(the file is in the page cache after the first read: what every run after the first sees).
"""

import argparse
import hashlib
import platform
import sys
import tempfile
import time
import zlib
from pathlib import Path

import torch

# the course's packages where they are not installed (pip install -e .), as on a GPU node
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from utils.data import Corpus, _load_cached, _save_cached  # noqa: E402
from utils.files import crc32_file, torch_file_problem  # noqa: E402


def fastest(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=103_227_021, help="training tokens")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--dir", help="where to write the cache (default: a temporary folder)")
    args = p.parse_args()
    g = torch.Generator().manual_seed(0)
    corpus = Corpus([f"w{i}" for i in range(32768)],
                    torch.randint(32768, (args.tokens,), generator=g),
                    torch.randint(32768, (217_646,), generator=g),
                    torch.randint(32768, (245_569,), generator=g), "synthetic-wikitext-103")
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        path = Path(tmp) / "cache.pt"
        _save_cached(corpus, path)
        gb = path.stat().st_size / 1e9
        load = fastest(lambda: torch.load(path, weights_only=True), args.repeat)
        check = fastest(lambda: torch_file_problem(path), args.repeat)
        both = fastest(lambda: _load_cached(path), args.repeat)
        crc = fastest(lambda: crc32_file(path), args.repeat)
        data = path.read_bytes()
        crc_mem = fastest(lambda: zlib.crc32(data), args.repeat)
        sha_mem = fastest(lambda: hashlib.sha256(data).digest(), args.repeat)
    print(f"CPU: {cpu_name()}; torch {torch.__version__}; zlib {zlib.ZLIB_RUNTIME_VERSION}")
    print(f"cache file: {args.tokens:,} training tokens, {gb:.2f} GB (fastest of {args.repeat})")
    print("| what | seconds | GB/s |\n|---|---|---|")
    for name, seconds in [("torch.load (unchecked, as before)", load),
                          ("checking the CRC-32s of the file (torch_file_problem)", check),
                          ("reading the cache as the scripts do (check + load)", both),
                          ("CRC-32 of the file (crc32_file, DCP manifests)", crc),
                          ("CRC-32 of the bytes in memory (zlib.crc32)", crc_mem),
                          ("SHA-256 of the bytes in memory (hashlib), for comparison", sha_mem)]:
        print(f"| {name} | {seconds:.3f} | {gb / seconds:.1f} |")
    print(f"the check adds {check:.2f} s to a {load:.2f} s load: {check / load:.0%}")


if __name__ == "__main__":
    main()
