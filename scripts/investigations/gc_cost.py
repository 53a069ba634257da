"""What one full garbage collection costs with the benchmark's heap (two Qwen2.5-Coder-0.5B targets
loaded, as bench_speedup holds), and after `gc.freeze()` (qdflash.bench.run_interleaved).

    python scripts/investigations/gc_cost.py
"""

from __future__ import annotations

import gc
import statistics
import time

from qdflash.models import load_target


def collect_ms(times: int = 5) -> float:
    samples = []
    for _ in range(times):
        start = time.perf_counter()
        gc.collect()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def main() -> None:
    targets = [load_target("qwen2.5-coder-0.5b", dtype="float32", device="cpu") for _ in range(2)]
    objects = len(gc.get_objects())
    before = collect_ms()
    gc.freeze()
    after = collect_ms()
    gc.unfreeze()
    print(f"{len(targets)} targets, {objects} objects: a full collection {before:.1f} ms; after gc.freeze() {after:.3f} ms")


if __name__ == "__main__":
    main()
