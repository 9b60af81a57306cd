"""Host memory maps held by a serving CPU process (CPU, Linux): whether a long CPU-only engine process can reach
Linux's limit (`vm.max_map_count`, 65,530 by default), after which XLA's CPU compiler segfaults on the next compile.
Every compiled program holds host memory maps: an engine that compiled programs for each new request layout added
about 830 per request of this model and reached the limit after about 77 requests of new lengths.

Builds a tiny random Qwen3.5-MoE checkpoint with transformers (2 layers: GDN then full attention, hidden 64, 8
experts top-2 with a shared expert; the shape of the test suite's tiny checkpoint), serves it with
`hypic_jax.Engine` warmed up first (its ladder of programs compiled), then sends requests whose segment lengths
are all new and prints the process's map count after each: a bounded set of programs adds none.

    python bench/program_maps.py               # 6 requests
    python bench/program_maps.py --requests 20
"""

from __future__ import annotations

import argparse
import tempfile
import time

# transformers' Qwen3_5MoeTextConfig fields of the tiny checkpoint
TINY_MOE = dict(
    vocab_size=128, hidden_size=64, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4, initializer_range=0.05,
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
)


def map_count() -> int:
    """How many memory maps this process holds (Linux: one line each in /proc/self/maps)."""
    with open("/proc/self/maps", "rb") as f:
        return sum(1 for _ in f)


def save_tiny_checkpoint(folder: str, seed: int = 0) -> None:
    """A random float32 Qwen3.5-MoE checkpoint of the TINY_MOE shape, written with `save_pretrained`."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**TINY_MOE))
    model.float().eval().save_pretrained(folder)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=6)
    args = parser.parse_args()

    import numpy as np

    from hypic_jax.engine import Engine, backend_compiles

    with tempfile.TemporaryDirectory() as folder:
        save_tiny_checkpoint(folder)
        engine = Engine.from_pretrained(folder, dtype="float32", seam=4, max_prompt_tokens=256, max_segments=4,
                                        max_new_tokens=8, max_batch=1, token_rungs=(256,), cache_bytes=1 << 24,
                                        compile_cache="none")
        warm = engine.warmup(progress=False)
    print(f"warmup: {warm['programs']} programs", flush=True)
    compiled = backend_compiles()
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
    print(f"compilations while serving: {backend_compiles() - compiled}", flush=True)
    if per > 0:
        print(f"about {(limit - start) / per:.0f} such requests reach the limit", flush=True)
    else:
        print("the requests added no maps: they cannot reach the limit", flush=True)


if __name__ == "__main__":
    main()
