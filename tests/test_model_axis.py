"""The span programs' linear cores and attention under a model axis (`stitch.model_split`): traced under a mesh
whose "model" axis has M devices, each device runs them on its 1/M of the heads (`jax.shard_map`), which lets the
Pallas kernels read only their share of the split pools.

On fake CPU devices (a subprocess: the device count is fixed when JAX starts), on a random layout of every program
kind, GDN and KDA, the XLA loops and the Pallas kernels (interpreted): the results under meshes of 2 and 4 model
devices (4 does not divide the 2 key heads, which are then repeated) equal the results without a mesh, every
kernel call of the traced program sits inside the split and sees 1/M of the heads, and attention with 2 key heads
splits over 2 devices and runs whole over 4.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from helpers import LONG, fake_devices_env

TESTS = Path(__file__).parent

_SCRIPT = r"""
import sys
sys.path.insert(0, sys.argv[1])
import functools
import numpy as np, jax, jax.numpy as jnp
from jax.sharding import Mesh
from hypic_jax.stitch import layout as lay
from hypic_jax import stitch
from helpers import LAYOUT_CAP as CAP, LAYOUT_HEADS, layout_core, layout_inputs, layout_pool, random_layout, rel_err

assert len(jax.devices()) == 4
TOL = 1e-5
HK, H, K, V = LAYOUT_HEADS


meshes = {m: Mesh(np.array(jax.devices()[:m]).reshape(1, m), ("data", "model")) for m in (2, 4)}


def walk(jaxpr, inside=False, found=None):
    # ("kernel", inside a shard_map) for every kernel call, ("split", local argument shapes) for every shard_map
    found = [] if found is None else found
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "pallas_call":
            found.append(("kernel", inside))
        if name == "shard_map":
            found.append(("split", [tuple(v.aval.shape) for v in eqn.params["jaxpr"].invars]))
        for param in eqn.params.values():
            for sub in (param if isinstance(param, (tuple, list)) else [param]):
                body = getattr(sub, "jaxpr", sub)
                if hasattr(body, "eqns"):
                    walk(body, inside or name == "shard_map", found)
    return found


rng = np.random.default_rng(11)
pool = layout_pool(rng)
checked = 0
for per_key in (False, True):
    for kind in ("cold", "plain", "pic"):
        isolated, summaries = kind == "cold", kind != "plain"
        _, arrays = random_layout(rng, kind)
        inputs = layout_inputs(rng, per_key)
        valid = np.asarray(arrays.valid)
        fresh = np.asarray(arrays.piece_kind) == lay.PIECE_FRESH
        for impl in ("xla", "pallas"):
            run = functools.partial(layout_core, inputs, pool, arrays, summaries=summaries, isolated=isolated,
                                    impl=impl)
            whole = run()
            for m, mesh in meshes.items():
                if m == 4 and not per_key:  # the mesh's size and the gates' form are independent: 4 devices once
                    continue
                with jax.set_mesh(mesh):
                    split = run()
                    traced = jax.make_jaxpr(run)()
                what = (per_key, kind, impl, m)
                assert rel_err(split[0][valid], whole[0][valid], norm="max") < TOL, what
                assert rel_err(split[1], whole[1], norm="max") < TOL, what
                if whole[2] is not None:
                    assert rel_err(split[2][fresh], whole[2][fresh], norm="max") < TOL, what
                if summaries and whole[3] is not None:
                    assert rel_err(split[3].state[fresh], whole[3].state[fresh], norm="max") < TOL, what
                    assert rel_err(split[3].transfer[fresh], whole[3].transfer[fresh], norm="max") < TOL, what
                for a, b in zip(jax.tree.leaves(split[4]), jax.tree.leaves(whole[4])):
                    assert rel_err(a, b, norm="max") < TOL, what
                found = walk(traced.jaxpr)
                local = [shape for what_, shapes in found if what_ == "split" for shape in shapes]
                # each device's values v: H / M heads of every fresh token; nothing whole goes in
                assert (CAP.tokens, H // m, V) in local and (CAP.tokens, H, V) not in local, (what, local)
                kernels = [inside for what_, inside in found if what_ == "kernel"]
                assert all(kernels) and (impl == "pallas") == bool(kernels), (what, found)
                checked += 1

# attention: 2 key heads, 4 query heads; split over 2 devices, whole over 4
_, arrays = random_layout(rng, "pic")
q = jnp.asarray(rng.standard_normal((CAP.tokens, 4, 16)), jnp.float32)
k = jnp.asarray(rng.standard_normal((CAP.keys, 2, 16)), jnp.float32)
v = jnp.asarray(rng.standard_normal((CAP.keys, 2, 16)), jnp.float32)
valid = np.asarray(arrays.valid)
for use_kernel in (False, True):
    attend = jax.jit(functools.partial(stitch.masked_attention, isolated=False, scale=0.25, use_kernel=use_kernel))
    whole = attend(q, k, v, arrays)
    for m, mesh in meshes.items():
        with jax.set_mesh(mesh):
            split = attend(q, k, v, arrays)
            traced = str(jax.make_jaxpr(attend)(q, k, v, arrays))
        assert rel_err(np.asarray(split)[valid], np.asarray(whole)[valid], norm="max") < TOL, (use_kernel, m)
        assert ("shard_map" in traced) == (m == 2), (use_kernel, m)
        checked += 1
print("checked", checked)
"""


@LONG
def test_linear_core_and_attention_split_by_heads_over_a_model_axis():
    done = subprocess.run([sys.executable, "-c", _SCRIPT, str(TESTS)], env=fake_devices_env(4), capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    assert "checked 22" in done.stdout, done.stdout[-2000:]
