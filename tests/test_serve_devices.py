"""`hypic-jax serve --devices N --policy P`: the server's cold segments prefilled over a mesh of N devices; and
`--tensor-parallel-size M`: the model split over M devices.

On 2 fake CPU devices (a subprocess: the device count is fixed when JAX starts), with the round-robin policy, with
the model split over both devices, and with both at once (the LPT policy), a request whose segments are all cold
gives the single-device server's greedy tokens and log-probabilities, with nothing compiled after warmup. A device
count below 1 or above the devices the process sees, and an unknown policy, are refused with an error naming the
option.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest

from helpers import LONG, fake_devices_env

pytest.importorskip("starlette")
pytest.importorskip("httpx")

_SERVE_SCRIPT = r"""
import json, sys
import jax, numpy as np
from starlette.testclient import TestClient
from hypic_jax.checkpoint import write_metadata
from hypic_jax.demo import tiny_model
from hypic_jax.serve.app import build

assert len(jax.devices()) == 2
folder = sys.argv[1]
# the demo's tiny model: random weights of one seed (`--load-format dummy`), the same in both servers
write_metadata(folder, model_type="qwen3_5", config=tiny_model().config, dtype="float32")
options = dict(dtype="float32", load_format="dummy", max_prompt_tokens=128, token_rungs=(128,), max_segments=8,
               max_new_tokens=8, max_batch=1, cache_bytes=1 << 24, seam=4)
rng = np.random.default_rng(0)
segments = [rng.integers(0, 512, n).tolist() for n in (40, 9, 23, 12, 5)]  # the last one is the query
body = dict(segments=segments, max_tokens=8, temperature=0, logprobs=5, return_token_ids=True)
out = {}
# the policies' bins are checked on the engine (tests/test_parallel.py); the server passes --policy on
for devices, policy, split in ((None, "lpt", None), (2, "rr", None), (None, "lpt", 2), (2, "lpt", 2)):
    server = build(folder, devices=devices, policy=policy, tensor_parallel=split, **options)
    server.warm_on_start = False
    mesh = server.engine.segment_mesh
    assert (mesh is None) == (devices is None)
    assert (server.engine.placement is None) == (split is None)
    server.warmup()
    try:
        client = TestClient(server.app)
        response = client.post("/v1/completions", json=body)
        metrics = client.get("/metrics").text
    finally:
        server.scheduler.stop()
    assert response.status_code == 200, response.text
    answer = response.json()
    pic = answer["usage"]["pic"]
    assert pic["misses"] == 4 and pic["hits"] == 0 and pic["cold_tokens"] > 0, pic
    assert server.engine.stats["programs"]["serving_compiles"] == 0
    if mesh is not None and split is None:
        # both devices prefilled segments
        assert mesh.size == 2 and mesh.policy == policy and all(mesh.last["bins"]), mesh.last
        # each device keeps the entries it computed; the first device's copies of the other's were fetched
        from prometheus_client.parser import text_string_to_metric_families
        families = {f.name: f for f in text_string_to_metric_families(metrics)}
        held = {s.labels["device"]: s.value for s in families["hypic:device_cache_entries"].samples}
        other = len(mesh.last["bins"][1])
        assert held == {"0": 4, "1": other}, held
        fetched = [s.value for s in families["hypic:device_cache_fetches"].samples if s.name.endswith("_total")]
        assert fetched == [other], fetched
    choice = answer["choices"][0]
    out[f"{devices}-{policy}" + (f"-tp{split}" if split else "")] = dict(tokens=choice["token_ids"], logprobs=choice["logprobs"]["token_logprobs"],
                                      top=choice["logprobs"]["top_logprobs"])
# --peer-cache-gb (peer_cache_bytes): a tier on the other device
peered = build(folder, devices=2, peer_cache_bytes=1 << 22, **options).engine.tiers
assert len(peered.peers) == 1 and peered.peers[0].capacity_bytes == 1 << 22 and peered.enabled
print(json.dumps(out))
"""


@LONG
def test_two_devices_serve_the_single_device_greedy_answer(tmp_path):
    done = subprocess.run([sys.executable, "-c", _SERVE_SCRIPT, str(tmp_path)], env=fake_devices_env(2),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    one = out.pop("None-lpt")
    assert len(one["tokens"]) == 8 and set(out) == {"2-rr", "None-lpt-tp2", "2-lpt-tp2"}
    for name, two in out.items():
        assert two["tokens"] == one["tokens"], name
        assert max(abs(a - b) for a, b in zip(two["logprobs"], one["logprobs"])) <= 1e-4, name
        for a, b in zip(two["top"], one["top"]):
            assert a.keys() == b.keys() and all(abs(a[k] - b[k]) <= 1e-4 for k in a), name


def test_bad_devices_and_policy_are_refused_naming_the_option(capsys, monkeypatch):
    import jax

    from hypic_jax import cli
    from hypic_jax.serve.app import build

    for bad in ("0", "-1", "two"):
        with pytest.raises(SystemExit) as exit_:
            cli.main(["serve", "--devices", bad])
        assert exit_.value.code == 2 and "argument --devices" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["serve", "--policy", "random"])
    assert "argument --policy" in capsys.readouterr().err
    too_many = len(jax.devices()) + 1
    monkeypatch.setattr(logging, "basicConfig", lambda **kw: None)  # serve's logging set-up: not in this process
    assert cli.main(["serve", "--devices", str(too_many)]) == 2
    err = capsys.readouterr().err
    assert f"--devices {too_many}" in err and f"from 1 to {too_many - 1}" in err, err
    # `build` takes the engine's options by field name: its errors name the field (a count past the machine's
    # devices is checked by `build` itself, naming the flag)
    with pytest.raises(ValueError, match="devices must be a device count >= 1"):
        build(devices=0)
    with pytest.raises(ValueError, match="policy must be one of"):
        build(policy="random")
    with pytest.raises(ValueError, match="peer_cache_bytes needs the engine's other devices"):
        build(peer_cache_bytes=1 << 29)
    with pytest.raises(ValueError, match="tensor_parallel must be a device count >= 1"):
        build(tensor_parallel=0)
    with pytest.raises(ValueError, match=f"--tensor-parallel-size {too_many}"):
        build(tensor_parallel=too_many)
    with pytest.raises(ValueError, match=f"--devices {too_many}"):
        build(devices=too_many)
    assert cli.main(["serve", "--tp", str(too_many)]) == 2
    assert f"--tensor-parallel-size {too_many}" in capsys.readouterr().err
    assert cli.main(["serve", "--peer-cache-gb", "0.5"]) == 2  # a peer tier without --devices
    assert "peer_cache_bytes needs the engine's other devices" in capsys.readouterr().err
