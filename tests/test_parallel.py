"""Segment parallelism (`hypic_jax.parallel.policy`, `hypic_jax.parallel.segments`).

The policies: every segment lands in exactly one bin; LPT's makespan stays within 5% of the lower bound
max(costliest segment, total / devices) on skewed lengths, and beats round-robin on a case built against it; the
cost model fits its constants from measurements. The mesh path: on 2, 4 and 8 fake CPU devices, with LPT and
round-robin, an `Engine(devices=...)` gives the single-device engine's logits and cache entries (in the pools of the
device that computed each, and the home device's copies), serves entries that left the home device from the devices
that hold them, and compiles nothing after warmup (`devices=1` is the one-device engine, with no mesh); a home
entry held on another device is not demoted, and `persist` writes every device's entries to disk (one subprocess:
the device count is fixed when JAX starts).
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from hypic_jax.parallel import policy as par
from helpers import LONG, fake_devices_env


def _skewed(seed: int, count: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(n) for n in np.clip(rng.lognormal(5.0, 1.0, count), 8, 8192).astype(int)]


@pytest.mark.parametrize("devices", [2, 4, 8])
def test_lpt_is_near_the_lower_bound_on_skewed_lengths(devices):
    cost = par.SegmentCost()
    for seed in range(50):
        lengths = _skewed(seed, 64)
        bins = par.lpt(lengths, devices, cost)
        assert par.makespan(bins, lengths, cost) <= 1.05 * par.lower_bound(lengths, devices, cost), (seed, lengths)


@pytest.mark.parametrize("policy", par.POLICIES)
@pytest.mark.parametrize("devices", [1, 3, 8])
def test_every_segment_is_assigned_once(policy, devices):
    for seed in range(10):
        lengths = _skewed(seed, int(np.random.default_rng(seed).integers(1, 40)))
        bins = par.assign(policy, lengths, devices, par.SegmentCost())
        assert len(bins) == devices
        assert sorted(i for b in bins for i in b) == list(range(len(lengths)))


def test_lpt_beats_round_robin_where_round_robin_stacks_the_long_segments():
    """Long and short segments alternating: round-robin puts every long one on bin 0."""
    lengths = [2048, 64] * 8
    cost = par.SegmentCost()
    lpt = par.makespan(par.lpt(lengths, 2, cost), lengths, cost)
    rr = par.makespan(par.round_robin(lengths, 2), lengths, cost)
    assert lpt < rr
    assert lpt <= 1.05 * par.lower_bound(lengths, 2, cost)
    assert rr > 1.5 * lpt


def _rung(rungs, tokens):
    return next((r for r in sorted(rungs) if r >= tokens), float("inf"))


def test_lpt_repacks_its_bins_under_a_smaller_rung_where_they_fit():
    """Greedy LPT puts [5, 5, 4, 3, 3] on 2 devices as 11 / 9 tokens, one past the rung of 10; a split of 10 / 10
    exists, and with the rungs LPT finds it."""
    lengths, rungs = [5, 5, 4, 3, 3], [10, 20]
    plain = par.lpt(lengths, 2, par.SegmentCost())
    assert max(sum(lengths[i] for i in b) for b in plain) == 11
    packed = par.lpt(lengths, 2, par.SegmentCost(), rungs)
    assert sorted(i for b in packed for i in b) == list(range(5))
    assert [sum(lengths[i] for i in b) for b in packed] == [10, 10]


@pytest.mark.parametrize("devices", [1, 2, 3, 4, 8])
def test_lpt_with_rungs_never_needs_a_larger_rung_and_stays_a_partition(devices):
    """Random lengths and ladders: the bins with rungs are a partition whose largest bin needs no larger rung than
    plain LPT's, and no rung below the one any split needs; where plain LPT already fits the smallest rung it
    could, the bins are plain LPT's."""
    rng = np.random.default_rng(devices)
    cost = par.SegmentCost()
    for _ in range(200):
        lengths = [int(n) for n in rng.integers(1, 300, int(rng.integers(1, 30)))]
        rungs = sorted({int(r) for r in rng.integers(16, 2000, int(rng.integers(1, 6)))})
        plain = par.lpt(lengths, devices, cost)
        packed = par.lpt(lengths, devices, cost, rungs)
        assert len(packed) == devices and sorted(i for b in packed for i in b) == list(range(len(lengths)))
        top = lambda bins: max(sum(lengths[i] for i in b) for b in bins)  # noqa: E731
        assert _rung(rungs, top(packed)) <= _rung(rungs, top(plain)), (lengths, rungs)
        floor = max(max(lengths), -(-sum(lengths) // devices))
        assert _rung(rungs, top(packed)) >= _rung(rungs, floor)
        if _rung(rungs, top(plain)) == _rung(rungs, floor):
            assert packed == plain


def test_cost_model_defaults_then_calibration():
    cost = par.SegmentCost()
    assert (cost.a, cost.b, cost.c) == par.DEFAULT_SEGMENT_COST and not cost.calibrated
    assert not cost.calibrate()  # no samples: the defaults stay
    truth = par.SegmentCost(3e-4, 5e-6, 2e-9)
    for lengths in ([512], [256], [128] * 4, [64] * 8, [1024], [100, 300]):
        cost.observe(lengths, truth.bin_seconds(lengths))
    assert cost.calibrate() and cost.calibrated
    np.testing.assert_allclose([cost.a, cost.b, cost.c], [truth.a, truth.b, truth.c], rtol=1e-6)
    assert cost(700) == pytest.approx(truth(700))


def test_bad_devices():
    import jax

    from hypic_jax.parallel.segments import resolve_devices

    assert resolve_devices(1) == jax.devices()[:1]
    for bad in (0, len(jax.devices()) + 1, [], [jax.devices()[0]] * 2):
        with pytest.raises(ValueError, match="devices"):
            resolve_devices(bad)


def test_bad_arguments():
    with pytest.raises(ValueError, match="policy"):
        par.assign("random", [4], 2)
    with pytest.raises(ValueError, match="devices"):
        par.lpt([4], 0)
    with pytest.raises(ValueError, match="at least one token"):
        par.round_robin([4, 0], 2)
    with pytest.raises(ValueError, match=">= 0"):
        par.SegmentCost(-1.0)


_MESH_SCRIPT = r"""
import numpy as np, jax, jax.numpy as jnp
from hypic_jax.models import qwen3_5
from hypic_jax.models.base import Model
from hypic_jax.engine import Engine, KernelOptions, backend_compiles

assert len(jax.devices()) == 8
# the demo's tiny model cut to one Gated DeltaNet and one full-attention layer (both kinds of pooled entry), with
# its slow decay; prefill only (no generation, one decode row): the mesh path is the cold path
config = qwen3_5.Config(
    vocab_size=512, hidden_size=64, layer_types=("linear_attention", "full_attention"), mlp_types=("dense",) * 2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, rotary_dim=8, linear_num_key_heads=2,
    linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, intermediate_size=128)
params = qwen3_5.init_params(config, jax.random.key(0), jnp.float32)
params["layers"][0]["mixer"]["A_log"] = jnp.full_like(params["layers"][0]["mixer"]["A_log"], np.log(0.03))
model = Model(qwen3_5, config, params)
base = dict(max_prompt_tokens=128, max_segments=8, token_rungs=(128,), max_new_tokens=0, max_batch=1,
            cache_bytes=1 << 20, mean_entry_tokens=32, seam=4, eviction="lru", kernels=KernelOptions(chunk_size=16))
rng = np.random.default_rng(0)
docs = [rng.integers(0, 512, n).tolist() for n in (40, 9, 6, 20, 12, 8)]
new = rng.integers(0, 512, 14).tolist()
query = rng.integers(0, 512, 5).tolist()
requests = [docs + [query], [docs[3], new, docs[0], docs[5], query]]

def entries(engine, cache=None, pools=None):
    out = {}
    for entry in (engine.cache if cache is None else cache).entries():
        parts = []
        for kind, pool, base in (engine.pools if pools is None else pools).layers():
            index = base + (entry.slot if kind == "slot" else np.asarray(entry.rows))
            parts += [np.asarray(leaf)[index] for leaf in jax.tree.leaves(pool)]
        out[entry.key] = parts
    return out

def same(got, want, label):
    for key, parts in got.items():
        for a, b in zip(parts, want[key]):
            assert a.shape == b.shape and float(np.abs(a - b).max()) <= 1e-5, (label, key)

ref = Engine(model, **base)
ref.warmup(progress=False)
ref_logits = [ref.prefill(r).logits for r in requests]
ref_entries = entries(ref)
assert len(ref_entries) == 7 and all(np.abs(p).max() > 0 for e in ref_entries.values() for p in e)

# one device is the one-device engine: no segment mesh, the same logits
one = Engine(model, **base, devices=1)
one.programs._compiled.update(ref.programs._compiled)
assert one.segment_mesh is None
one.warmup(progress=False)
before = backend_compiles()
for r, want in zip(requests, ref_logits):
    assert float(np.abs(one.prefill(r).logits - want).max()) <= 1e-5
assert backend_compiles() == before and set(entries(one)) == set(ref_entries)

shared = {}
for n in (2, 4, 8):
    for policy in ("lpt", "rr"):
        # two devices away from the home one (where the pools live): the records travel back to it
        devices = jax.devices()[6:8] if (n, policy) == (2, "rr") else n
        engine = Engine(model, **base, devices=devices, policy=policy)
        engine.programs._compiled.update(ref.programs._compiled)  # same shapes: the reference's programs
        mesh = engine.segment_mesh
        assert mesh.size == n and mesh.home == jax.devices()[0]
        # where the mesh holds the home device, the replicated weights' shards there are the engine's own buffers
        # (no second copy of the weights on it)
        for mine, rep in zip(jax.tree.leaves(engine.params), jax.tree.leaves(mesh.params)):
            home = [s.data for s in rep.addressable_shards if s.device == mesh.home]
            assert len(home) == (mesh.home in mesh.devices)
            assert all(h.unsafe_buffer_pointer() == mine.unsafe_buffer_pointer() for h in home)
        if (n, devices is n) in shared:  # the policies share the mesh programs of the same devices
            mesh._cold, mesh._commit = shared[n, devices is n]
        engine.warmup(progress=False)
        shared[n, devices is n] = (mesh._cold, mesh._commit)
        before = backend_compiles()
        for r, want in zip(requests, ref_logits):
            got = engine.prefill(r)
            err = float(np.abs(got.logits - want).max())
            assert err <= 1e-5, (n, policy, err)
            bins = mesh.last["bins"]
            assert len(bins) == n and sum(len(b) for b in bins) == got.stats.misses
            assert sum(1 for b in bins if b) == min(n, got.stats.misses), bins
        assert backend_compiles() == before, (n, policy, backend_compiles() - before)
        assert engine.stats["programs"]["serving_compiles"] == 0
        got_entries = entries(engine)
        assert set(got_entries) == set(ref_entries)
        same(got_entries, ref_entries, (n, policy, "home"))
        # every entry stays in the pools of the device that computed it (the home device's are the engine's):
        # the home pools hold a copy of the others'
        pools = mesh.pools
        remote = {}
        for k in range(n):
            if pools.remote(k):
                remote.update(entries(engine, pools.caches[k], pools.pools[k]))
        same(remote, ref_entries, (n, policy, "remote"))
        assert pools.stats.fetches == len(remote), (pools.stats, len(remote))
        assert len(remote) == 7 if pools.home_index is None else (n == 1) == (not remote), (n, len(remote))
        # a request whose entries left the home device is served from the devices that hold them
        engine.cache.clear()
        held = sum(1 for d in docs if any(e.tokens == tuple(d) for e in pools.entries()))
        got = engine.prefill(requests[0])
        assert float(np.abs(got.logits - ref_logits[0]).max()) <= 1e-5, (n, policy)
        assert got.stats.hits == held and got.stats.misses == len(docs) - held, (got.stats, held)
        assert pools.stats.remote_hits >= held
        assert backend_compiles() == before, (n, policy, backend_compiles() - before)
        print(n, policy, mesh.last["bins"], pools.as_dict(), flush=True)

# lower tiers: a home entry that another device still holds is not demoted (that device's pools are the copy);
# `persist` writes every device's entries, and an engine of one device serves them from disk
import tempfile
folder = tempfile.mkdtemp()
engine = Engine(model, **base, devices=2, host_cache_bytes=1 << 20, disk_cache_dir=folder)
engine.programs._compiled.update(ref.programs._compiled)
mesh = engine.segment_mesh
mesh._cold, mesh._commit = shared[2, True]
engine.warmup(progress=False)
engine.prefill(requests[0])
remote = {e.key for e in mesh.pools.entries()}
assert 0 < len(remote) < 6
left = engine.demote_all()
assert left == 6 and engine.tiers.demotions == 6 - len(remote), (left, engine.tiers.demotions, len(remote))
assert engine.persist() == 6
restarted = Engine(model, **base, disk_cache_dir=folder)
restarted.programs._compiled.update(ref.programs._compiled)
restarted.warmup(progress=False)
got = restarted.prefill(requests[0])
assert got.stats.hits == 6 and got.stats.cold_tokens == 0, got.stats
assert float(np.abs(got.logits - ref_logits[0]).max()) <= 1e-5
# written through: every new entry reaches the disk when it is stored, on whichever device it stays
through = Engine(model, **base, devices=2, disk_cache_dir=tempfile.mkdtemp(), disk_write_through=True)
through.programs._compiled.update(ref.programs._compiled)
through.segment_mesh._cold, through.segment_mesh._commit = shared[2, True]
through.warmup(progress=False)
through.prefill(requests[0])
assert through.segment_mesh.pools.entries() and through.tiers.disk.stats.entries == 6, through.tiers.disk.stats
print("ok")
"""


@LONG
def test_mesh_cold_path_matches_one_device_on_fake_meshes():
    env = fake_devices_env(8)
    done = subprocess.run([sys.executable, "-c", _MESH_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout[-2000:] + done.stderr[-3000:]
