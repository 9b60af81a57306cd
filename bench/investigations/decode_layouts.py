"""Whether the batched decode cache in the compiler's layouts (`KernelOptions(slot_layouts="auto")`) decodes what
the row-major cache does on this backend: four prompts prefilled, each inserted into its row (the insert program),
then every row stepped (the batch programs), once per layout choice; the sampled ids and log-probabilities of
every call compared. On a CPU the compiler keeps row-major layouts (tests/test_layer_stack.py forces others);
this is the check for a GPU, where it picks others.

    python -m bench.investigations.decode_layouts [--layers 8]     # the 35B-A3B shape, random bf16 weights (GPU)
    python -m bench.investigations.decode_layouts --small          # CPU size
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def decode_calls(engine, prompts, steps: int) -> list[tuple]:
    """(ids, log-probabilities...) of each prompt's insert into its row, then of `steps` greedy steps of all rows."""
    from hypic_jax.engine.sampling import SamplingRows

    out = []
    for row, segs in enumerate(prompts):
        sampled = engine.slot_insert(row, engine.prefill(segs, mode="full_recompute"),
                                     SamplingRows.build([0.0], [1.0], [0], [0], [0], [4]))
        out.append((np.asarray(sampled.ids), *sampled.logprobs()))
    tokens = np.concatenate([o[0] for o in out])
    lengths = np.asarray([sum(map(len, p)) for p in prompts])
    n = len(prompts)
    for step in range(steps):
        sampled = engine.slot_decode(tokens, lengths, SamplingRows.build([0.0] * n, [1.0] * n, [0] * n, [0] * n,
                                                                         [step + 1] * n, [4] * n))
        out.append((np.asarray(sampled.ids), *sampled.logprobs()))
        tokens, lengths = np.asarray(sampled.ids), lengths + 1
    return out


def main(argv=None) -> None:
    import jax
    import jax.numpy as jnp
    from bench.common import full_config, random_model, small_config

    from hypic_jax.engine import Engine, KernelOptions

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    config, dtype = (small_config(), jnp.float32) if args.small else (full_config(args.layers), jnp.bfloat16)
    model = random_model(config, dtype)
    rng = np.random.default_rng(5)
    prompts = [[rng.integers(3, min(5000, config.vocab_size), n).tolist() for n in lengths]
               for lengths in ((90, 20), (60, 7), (100, 3), (30, 30))]
    runs = {}
    for name in ("default", "auto"):
        engine = Engine(model, kernels=KernelOptions(slot_layouts=name), max_prompt_tokens=128, token_rungs=(128,),
                        max_new_tokens=8, max_batch=len(prompts), cache_bytes=1 << 28, compile_cache="none")
        engine.warmup(progress=False)
        runs[name] = decode_calls(engine, prompts, args.steps)
        print(f"{name}: done after {time.perf_counter() - started:.1f} s", flush=True)
        engine.close()
        del engine
    same = [bool(np.array_equal(a[0], b[0])) for a, b in zip(runs["auto"], runs["default"])]
    deviation = max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
                    for a, b in zip(runs["auto"], runs["default"]) for x, y in zip(a[1:], b[1:]))
    print(f"device {jax.devices()[0]}; ids equal in {sum(same)} of {len(same)} calls (inserts, then steps); "
          f"largest |log-probability difference| {deviation:.3g}")


if __name__ == "__main__":
    main()
