"""Tensor parallelism: `Engine(tensor_parallel=M)` splits the parameters over a ("data", "model") mesh of M
devices by each architecture's `param_specs` and the pools over its "model" axis (`pools.split_spec`), and runs
every program over the mesh, the span programs' linear cores and attention on each device's own heads
(`stitch.model_split`); with `devices=` beside it the segment mesh's cold bins come back gathered and are committed
into the split pools, where the stitched program reads them.

On fake CPU devices (a subprocess: the device count is fixed when JAX starts), for every architecture: the logits of
a random trace over every mode, the cache entries, greedy generation and the batched decode rows equal the
single-device engine's (and, for the MoE checkpoint, those of a split engine whose cold segments run on a segment
mesh of two other devices); nothing compiles after warmup; options the mesh cannot take are refused by name.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from helpers import LONG, arch_params, fake_devices_env

TESTS = Path(__file__).parent

_SCRIPT = r"""
import sys
sys.path.insert(0, sys.argv[3])
import numpy as np, jax
from helpers import load_tiny, rel_err
from hypic_jax.engine import Engine
from hypic_jax.engine.sampling import TOP_LOGPROBS, SamplingRows

arch, folder = sys.argv[1], sys.argv[2]
assert len(jax.devices()) == 8
model, vocab, _ = load_tiny(arch, folder)
base = dict(max_prompt_tokens=256, max_segments=6, token_rungs=(256,), max_new_tokens=8, cache_bytes=1 << 22,
            seam=4, max_batch=2)


def _batched_steps(engine, prompts, steps):
    # greedy rows: each prompt's prefill inserted into its row, then `steps` steps of every row; per call the
    # sampled ids and their log-probabilities
    out = []
    for row, segs in enumerate(prompts):
        pre = engine.prefill(segs, mode="full_recompute")
        sampled = engine.slot_insert(row, pre, SamplingRows.build([0.0], [1.0], [0], [0], [0], [TOP_LOGPROBS]))
        out.append((sampled.ids, sampled.logprobs()[0]))
    tokens = np.concatenate([ids for ids, _ in out])
    lengths = np.asarray([sum(map(len, segs)) for segs in prompts])
    rows = len(prompts)
    for step in range(steps):
        sampled = engine.slot_decode(tokens, lengths, SamplingRows.build(
            [0.0] * rows, [1.0] * rows, [0] * rows, [0] * rows, [step + 1] * rows, [TOP_LOGPROBS] * rows))
        out.append((sampled.ids, sampled.logprobs()[0]))
        tokens, lengths = sampled.ids, lengths + 1
    return out

rng = np.random.default_rng(0)
corpus = [rng.integers(3, vocab, n).tolist() for n in (40, 9, 70, 20, 33, 8)]
modes = ("transition_rope_recompute", "prefix_cache", "full_recompute", "transition_rope", "transition", "addition")
requests = []
for r in range(9):
    docs = [corpus[i] for i in rng.choice(len(corpus), int(rng.integers(1, 5)), replace=False)]
    requests.append((docs + [rng.integers(3, vocab, int(rng.integers(1, 12))).tolist()], modes[r % len(modes)],
                     [4, 0, 1.0][r % 3]))

from hypic_jax import stitch
splits = []  # the span programs' linear cores and attention run on each device's heads (`stitch.model_split`)
_over_heads = stitch._over_heads
stitch._over_heads = lambda fn, split, whole: splits.append(fn) or _over_heads(fn, split, whole)
ref = Engine(model, **base)
split = Engine(model, **base, tensor_parallel=2)
split.warmup(progress=False)
assert splits
meshes = [("split", split, [0, 1])]
if arch == "qwen_moe":  # the cold bins on two other devices, the stitched programs on the model mesh (the
    # composition does not depend on the architecture: one checks it)
    composed = Engine(model, **base, tensor_parallel=jax.devices()[2:4], devices=jax.devices()[4:6])
    assert composed.segment_mesh.gathered and composed.segment_mesh.pools is None
    composed.warmup(progress=False)
    meshes.append(("composed", composed, [2, 3]))
traced = len(splits)  # from here on only `ref` compiles, on one device: no split

# every pool over both devices of its mesh, split where an axis of its pieces allows (each leaf of this model's)
for _, engine, ids in meshes:
    for leaf in jax.tree.leaves(engine.pools.arrays):
        assert sorted(d.id for d in leaf.sharding.device_set) == ids
        assert 2 * leaf.addressable_shards[0].data.size == leaf.size, (leaf.shape, leaf.sharding)

for segments, mode, seam in requests:
    want = ref.prefill(segments, mode=mode, seam=seam).logits
    for name, engine, _ in meshes:
        got = engine.prefill(segments, mode=mode, seam=seam).logits
        assert rel_err(got, want) < 1e-5, (name, mode, seam, [len(s) for s in segments], rel_err(got, want))

def entries(engine):
    out = {}
    for entry in engine.cache.entries():
        parts = []
        for kind, pool, first in engine.pools.layers():
            index = first + (entry.slot if kind == "slot" else np.asarray(entry.rows))
            parts += [np.asarray(leaf)[index] for leaf in jax.tree.leaves(pool)]
        out[entry.key] = parts
    return out

want = entries(ref)
assert want and all(any(np.abs(p).max() > 0 for p in parts) for parts in want.values())
for name, engine, _ in meshes:
    got = entries(engine)
    assert got.keys() == want.keys(), name
    for key, parts in got.items():
        for a, b in zip(parts, want[key]):
            scale = max(float(np.abs(b).max()), 1e-30)
            assert a.shape == b.shape and float(np.abs(a - b).max()) <= 1e-5 * max(1.0, scale), (name, key)

segments = requests[0][0]
want = ref.generate(segments, max_new_tokens=5).tokens
for _, engine, _ in meshes:
    assert list(engine.generate(segments, max_new_tokens=5).tokens) == list(want)

prompts = [requests[1][0], requests[2][0]]
for a, b in zip(_batched_steps(ref, prompts, 3), _batched_steps(split, prompts, 3)):
    assert (np.asarray(a[0]) == np.asarray(b[0])).all(), (a[0], b[0])
    assert np.allclose(np.asarray(a[1]), np.asarray(b[1]), atol=1e-4)

for name, engine, _ in meshes:
    assert engine.stats["programs"]["serving_compiles"] == 0, name
assert len(splits) == traced, "the one-device engine's programs split nothing"
print("ok")
"""


# Qwen3.5 dense shares every layer but the MLP with the MoE checkpoint, whose experts split over the mesh too
@LONG
@pytest.mark.parametrize("arch", arch_params("tensor_parallel", ("qwen_moe", "ring", "kimi")))
def test_tensor_parallel_equals_one_device(arch, tiny_checkpoints):
    done = subprocess.run([sys.executable, "-c", _SCRIPT, arch, str(tiny_checkpoints(arch)[2]), str(TESTS)],
                          env=fake_devices_env(8), capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-4000:]


_REFUSALS = r"""
import sys
sys.path.insert(0, sys.argv[2])
import jax, pytest
from helpers import load_tiny, rel_err
from hypic_jax.engine import Engine

model, _, checkpoint = load_tiny("qwen_moe", sys.argv[3])
base = dict(max_prompt_tokens=64, max_segments=2, token_rungs=(64,), cache_bytes=1 << 22, max_batch=1)
for option in (dict(host_cache_bytes=1 << 20), dict(disk_cache_dir=sys.argv[1] + "/disk"),
               dict(peer_cache_bytes=1 << 20, devices=2)):
    with pytest.raises(ValueError, match="tiers need the model on one device"):
        Engine(model, **base, tensor_parallel=2, **option)
with pytest.raises(ValueError, match="divisible"):  # 4 value heads, 2 key heads
    Engine(model, **base, tensor_parallel=3)
with pytest.raises(ValueError, match="this process has 8"):
    Engine(model, **base, tensor_parallel=9)
with pytest.raises(ValueError, match="distinct"):
    Engine(model, **base, tensor_parallel=[jax.devices()[0]] * 2)
with pytest.raises(ValueError, match="other than the default"):
    Engine(model, **base, tensor_parallel=[jax.devices()[1]])
assert Engine(model, **base, tensor_parallel=1).placement is None  # one device: as without it

# a restarted engine loads its split programs from the store (each run on the devices of its mesh)
import numpy as np
stored = dict(base, compile_cache=sys.argv[1] + "/programs", max_new_tokens=4)
segments = [list(range(3, 40)), list(range(5, 20)), [7, 8, 9]]
want = Engine(model, **base, max_new_tokens=4).prefill(segments).logits
first = Engine(model, **stored, tensor_parallel=2).warmup(progress=False)
again = Engine(model, **stored, tensor_parallel=2)
loaded = again.warmup(progress=False)
assert first["loaded"] == 0 and loaded["loaded"] == loaded["programs"] == first["programs"] > 0, (first, loaded)
assert rel_err(again.prefill(segments).logits, want) < 1e-5

# random weights made split (`random_model(mesh=...)`, the server's --load-format dummy): those of the unsplit model
from hypic_jax.checkpoint import random_model
from hypic_jax.parallel.tensor import tensor_parallel_mesh
whole = jax.tree.leaves(random_model(checkpoint, "float32").params)
split = jax.tree.leaves(random_model(checkpoint, "float32", mesh=tensor_parallel_mesh(2)).params)
assert len(whole) == len(split) and all(len(b.sharding.device_set) == 2 for b in split)
assert all(np.allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7) for a, b in zip(whole, split))

# block-wise FP8 weights split like their weights (a scale whole where its rows cannot split): the one-device answer
from hypic_jax import models
fp8_model = model.replace(params=models.quantize_params(model.arch, model.params), source=model.source + ":fp8")
fp8 = dict(base, max_new_tokens=4)
fp8_want = Engine(fp8_model, **fp8).prefill(segments, mode="transition_rope_recompute", seam=4).logits
fp8_split = Engine(fp8_model, **fp8, tensor_parallel=2)
assert rel_err(fp8_split.prefill(segments, mode="transition_rope_recompute", seam=4).logits, fp8_want) < 1e-5
print("ok")
"""


@LONG
def test_tensor_parallel_refusals(tmp_path, tiny_checkpoints):
    """Tiers below the pools, uneven splits and missing devices are refused with errors that name them; a split
    over the one default device is the single-device engine; a restarted engine loads its split programs; random
    weights made split equal the unsplit ones; FP8 weights split answer as on one device."""
    done = subprocess.run([sys.executable, "-c", _REFUSALS, str(tmp_path), str(TESTS),
                           str(tiny_checkpoints("qwen_moe")[2])],
                          env=fake_devices_env(8), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-4000:]
