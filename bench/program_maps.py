"""Host memory maps held per compiled request layout (CPU): why a long CPU-only engine process can reach Linux's
limit (`vm.max_map_count`, 65,530 by default), after which XLA's CPU compiler segfaults on the next compile.

Builds the tests' tiny Qwen3.5-MoE checkpoint, then sends requests whose segment lengths are all new (each one
compiles its cold prefills and its span program) and prints the process's map count after each.

    python bench/program_maps.py               # 6 requests
    python bench/program_maps.py --requests 20
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=6)
    args = parser.parse_args()

    import numpy as np
    from families import map_count
    from qwen_helpers import build, save

    from hypic_jax.engine import Engine

    with tempfile.TemporaryDirectory() as folder:
        save(build("moe"), folder)
        engine = Engine.from_pretrained(folder, dtype="float32", seam=4)
    with open("/proc/sys/vm/max_map_count") as f:
        limit = int(f.read())
    rng = np.random.default_rng(0)
    start = map_count()
    print(f"limit {limit}, at start {start}", flush=True)
    for i in range(args.requests):
        segs = [rng.integers(3, 128, 8 + i).tolist() for _ in range(3)] + [rng.integers(3, 128, 5).tolist()]
        t0 = time.perf_counter()
        engine.prefill(segs)
        now = map_count()
        print(f"request {i + 1} (segments of {8 + i} tokens): {now} maps, {(now - start) / (i + 1):.0f} per request, "
              f"{time.perf_counter() - t0:.1f} s", flush=True)
    per = (map_count() - start) / args.requests
    print(f"about {(limit - start) / per:.0f} such requests reach the limit", flush=True)


if __name__ == "__main__":
    main()
