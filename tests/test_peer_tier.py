"""The peer tier (`Engine(devices=N, peer_cache_bytes=...)`, `hypic_jax.cache.tiers.PeerStore`): entries demoted
from the engine's first device are kept in the memory of its other devices and promoted back by one copy between
devices.

On 4 fake CPU devices (a subprocess: the device count is fixed when JAX starts): demoted entries spread over the 3
other devices and are held there (their buffers live on those devices); a request over them promotes every one
from the peer tier and gives the same logits as before and as a single-device engine; a peer budget too small for
all of them sends what it evicts to the host tier, from which those are promoted; a request that fails after
taking an entry from the peer tier gives it back to a device; nothing compiles after warmup. The peer tier needs
other devices, and its budget cannot be negative.
"""

from __future__ import annotations

import subprocess
import sys

from helpers import LONG, fake_devices_env

_PEER_SCRIPT = r"""
import numpy as np, jax
from hypic_jax.demo import tiny_model
from hypic_jax.engine import Engine, backend_compiles

assert len(jax.devices()) == 4
model = tiny_model()
options = dict(max_prompt_tokens=256, token_rungs=(256,), max_segments=8, max_new_tokens=4, max_batch=1,
               cache_bytes=1 << 19, mean_entry_tokens=64, seam=4, eviction="lru")
rng = np.random.default_rng(0)
docs = [rng.integers(3, 200, int(n)).tolist() for n in rng.integers(24, 56, 6)]
query = [5, 6, 7]
single = Engine(model, **options).prefill(docs + [query]).logits

# every entry fits the peer tier
engine = Engine(model, devices=4, peer_cache_bytes=1 << 20, host_cache_bytes=1 << 20, **options)
engine.warmup(progress=False)
before = backend_compiles()
first = engine.prefill(docs + [query])
# the entries that other devices computed stay in their pools (`mesh_pools`), so evicting their home copies would
# demote nothing: dropped there, every entry is the home device's alone and goes to the peer tier
engine.segment_mesh.pools.clear()
engine.demote_all()
tiers = engine.stats["tiers"]
assert tiers["peer"]["entries"] == 6 and tiers["host"]["entries"] == 0, tiers
assert sorted(tiers["peer"]["entries_per_device"]) == [2, 2, 2], tiers  # the most room first: spread out
home = jax.devices()[0]
for store in engine.tiers.peers:
    assert store.device != home
    for pieces in store.values():
        assert pieces.staged.main.devices() == {store.device}
back = engine.prefill(docs + [query])
assert (back.stats.hits, back.stats.misses) == (6, 0)
assert engine.stats["tiers"]["promotions"] == {"peer": 6, "host": 0, "disk": 0}
np.testing.assert_allclose(back.logits, first.logits, rtol=0, atol=1e-6)
np.testing.assert_allclose(back.logits, single, rtol=0, atol=1e-5)

# a request that fails after taking its entries from the peer tier gives them back to a device
engine.demote_all()
def broken(*args, **kwargs):
    raise RuntimeError("the cold prefill failed")
engine._prefill_missing = broken
try:
    engine.prefill(docs[:4] + [rng.integers(3, 200, 30).tolist(), query])
    raise AssertionError("the request did not fail")
except RuntimeError as error:
    assert "cold prefill failed" in str(error)
del engine._prefill_missing
tiers = engine.stats["tiers"]
assert tiers["peer"]["entries"] == 6 and tiers["promotions"]["peer"] == 6, tiers  # the 4 taken are back
again = engine.prefill(docs + [query])
assert again.stats.hits == 6
np.testing.assert_allclose(again.logits, first.logits, rtol=0, atol=1e-6)

assert backend_compiles() == before, "a request compiled after warmup"

# a peer budget for about one entry per device: the rest go on to the host tier and come back from there
engine.demote_all()
largest = max(p.nbytes for store in engine.tiers.peers for p in store.values())
tight = Engine(model, devices=4, peer_cache_bytes=largest * 3 // 2, host_cache_bytes=1 << 20, **options)
tight.programs._compiled.update(engine.programs._compiled)
tight.mover.adopt(engine.mover)
tight.warmup(progress=False)
before = backend_compiles()
tight.prefill(docs + [query])
tight.segment_mesh.pools.clear()
tight.demote_all()
tiers = tight.stats["tiers"]
held = tiers["peer"]["entries"]
assert held + tiers["host"]["entries"] == 6 and 3 <= held < 6, tiers
assert all(1 <= n <= 2 for n in tiers["peer"]["entries_per_device"]), tiers
assert all(store.stats.bytes <= store.capacity_bytes for store in tight.tiers.peers)
assert tiers["peer"]["evictions"] + tiers["peer"]["skipped"] == 6 - held, tiers
back = tight.prefill(docs + [query])
assert back.stats.hits == 6
promotions = tight.stats["tiers"]["promotions"]
assert promotions["peer"] == held and promotions["host"] == 6 - held, promotions
np.testing.assert_allclose(back.logits, first.logits, rtol=0, atol=1e-6)
assert backend_compiles() == before, "a request compiled after warmup"

for bad, match in ((dict(peer_cache_bytes=1 << 20), "other devices"),
                   (dict(devices=4, peer_cache_bytes=-1), "peer_cache_bytes")):
    try:
        Engine(model, **bad, **options)
        raise AssertionError(f"{bad} was accepted")
    except ValueError as error:
        assert match in str(error), error
print("ok")
"""


@LONG
def test_peer_tier_holds_entries_on_the_other_devices_and_promotes_them_exactly():
    done = subprocess.run([sys.executable, "-c", _PEER_SCRIPT], env=fake_devices_env(4), capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout[-2000:] + done.stderr[-3000:]

