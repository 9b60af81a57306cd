"""Random inputs for every linear-attention family, built through the core's public constructors, plus an
independent float64 NumPy token-by-token recurrence to check them against; the property tests' hypothesis settings
(`examples`), the guard that keeps a test process under its memory-map limit (`trim_compiled_programs`),
`jitted`, which runs a function as one compiled program instead of op by op, and
`interpreter_threads_compiled_once`, which compiles each thread program of Pallas's Mosaic GPU interpreter once."""

from __future__ import annotations

import collections
import contextlib
import functools
import gc
import os
import threading

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, settings

from hypic_jax.core import linear_attn as la


_MAPS = "/proc/self/maps"


def _map_limit() -> int | None:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


_MAP_LIMIT = _map_limit()


def map_count() -> int | None:
    """How many memory maps this process holds (None where /proc does not exist)."""
    try:
        with open(_MAPS, "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return None


def trim_compiled_programs() -> None:
    """Clear JAX's caches once this process holds more than a third of the memory maps Linux allows it.

    XLA's CPU backend maps each compiled program's code into memory regions of its own, and JAX keeps every program
    it compiled for the life of the process. A test process that compiles tens of thousands of programs (every new
    shape of a property test is one) reaches `vm.max_map_count` (65,530 by default), and the next compile cannot
    map its code: the compiler dies with a segmentation fault. Clearing returns the maps, at the cost of compiling
    again whatever a later test needs. Does nothing where /proc does not exist."""
    if _MAP_LIMIT is None:
        return
    count = map_count()
    if count is not None and count > _MAP_LIMIT // 3:
        jax.clear_caches()
        gc.collect()


def _trimming(test):
    @functools.wraps(test)
    def run(*args, **kwargs):
        try:
            return test(*args, **kwargs)
        finally:
            trim_compiled_programs()

    return run


def examples(default: int):
    """Decorator of a property test: hypothesis settings with `default` examples (few: every new shape is a new
    compilation), or HYPIC_EXAMPLES of them when that is set in the environment, for a deeper search; no deadline.
    Each example ends with `trim_compiled_programs`, so a deep search stays under the process's memory-map limit.
    Goes above or below `@given`."""
    chosen = settings(max_examples=int(os.environ.get("HYPIC_EXAMPLES", default)), deadline=None,
                      suppress_health_check=[HealthCheck.too_slow])

    def apply(test):
        if hasattr(test, "hypothesis"):  # already wrapped by @given: guard the function it calls per example
            test.hypothesis.inner_test = _trimming(test.hypothesis.inner_test)
            return chosen(test)
        return chosen(_trimming(test))

    return apply


@contextlib.contextmanager
def interpreter_threads_compiled_once(max_programs: int = 64):
    """Within the block, Pallas's Mosaic GPU interpreter compiles each of its thread programs once instead of once
    per launch.

    The interpreter runs a kernel's grid as a loop whose body calls back into Python, and the callback runs every
    warpgroup's program (one jaxpr, the thread index an argument) on a thread of its own through
    `thread_map._run_jaxpr`, which traces, lowers and compiles that jaxpr anew on every call: a kernel of 16 grid
    points and 2 warpgroups compiles the same program 32 times (~0.4 s each on the CPU). Here the compiled program
    is kept per jaxpr and argument layout (the last `max_programs` of them) and called exactly as the interpreter
    calls it, so every grid point and thread still runs the same jaxpr on its own arguments. Does nothing where that
    function does not exist (another JAX)."""
    try:
        from jax._src.pallas.mosaic.interpret import thread_map
    except ImportError:
        thread_map = None
    original = getattr(thread_map, "_run_jaxpr", None)
    eval_jaxpr = getattr(getattr(thread_map, "jax_core", None), "eval_jaxpr", None)
    if original is None or eval_jaxpr is None:
        yield
        return

    def body(jaxpr, consts, *args):
        eval_jaxpr(jaxpr, consts, *args)

    programs: collections.OrderedDict = collections.OrderedDict()
    lock = threading.Lock()

    def run(jaxpr, consts, *args):
        leaves, tree = jax.tree.flatten((consts, args))
        key = (id(jaxpr), tree, tuple((np.shape(x), str(getattr(x, "dtype", type(x)))) for x in leaves))
        with lock:
            entry = programs.get(key)
            if entry is None:  # [jaxpr (kept alive: its id stays its own), compiled program, its lock]
                entry = programs[key] = [jaxpr, None, threading.Lock()]
                while len(programs) > max_programs:
                    programs.popitem(last=False)
            else:
                programs.move_to_end(key)
        with entry[2]:  # one thread compiles, the others of the launch wait for it
            if entry[1] is None:
                entry[1] = jax.jit(body, static_argnums=(0,)).trace(jaxpr, consts, *args).lower().compile()
        entry[1](consts, *args)

    thread_map._run_jaxpr = run
    try:
        yield
    finally:
        thread_map._run_jaxpr = original
        programs.clear()


def fake_devices_env(count: int = 8) -> dict:
    """The environment of a child process that sees `count` fake CPU devices (the device count is fixed when JAX
    starts, hence a subprocess): this process's XLA flags (conftest's fast CPU compilation among them) plus the
    device count."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={count}".strip()
    return {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}


def jitted(fn):
    """`fn` compiled as one program per layout of its arguments: array leaves are traced, every other leaf (ints,
    strings, floats, None, configs) is static and part of the cache key.

    Called eagerly, a function of the core runs op by op, and XLA compiles every op anew for every new shape (tens
    of compilations of ~50 ms each on the CPU, per shape); under `jitted` the same computation is one
    compilation. Use it for references and set-up; the code under test keeps the entry point the test names."""
    programs = {}

    def call(*args, **kwargs):
        leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
        traced = tuple(isinstance(x, (jax.Array, np.ndarray)) for x in leaves)
        static = tuple(None if t else x for t, x in zip(traced, leaves))
        key = (tree, traced, static)
        program = programs.get(key)
        if program is None:
            def flat(arrays):
                it = iter(arrays)
                full = [next(it) if t else x for t, x in zip(traced, static)]
                a, kw = jax.tree_util.tree_unflatten(tree, full)
                return fn(*a, **kw)

            program = programs[key] = jax.jit(flat)
        return program([x for t, x in zip(traced, leaves) if t])

    return functools.wraps(fn)(call)


class compiled:
    """Attribute access to `jitted` versions of a module's functions or a class's methods (one cache per name):
    `compiled(la).advance(summary, state)`, `compiled(la.LinearInputs).summarize(inputs, chunk_size=8)`."""

    def __init__(self, owner):
        self._owner = owner

    def __getattr__(self, name):
        fn = jitted(getattr(self._owner, name))
        setattr(self, name, fn)
        return fn


core = compiled(la)  # the core's functions, each one compiled program per argument layout
method = compiled(la.LinearInputs)  # LinearInputs' methods likewise, the inputs as the first argument


def array(x, dtype=None) -> jax.Array:
    """`x` on the device as `dtype` (cast by NumPy, with the same rounding): `jnp.asarray` of a NumPy array compiles
    a conversion program for every new shape, `jax.device_put` does not."""
    return jax.device_put(np.asarray(x, dtype))


FAMILIES = ("linear", "retnet", "lightning", "mamba2", "gla", "delta_net", "gated_delta_net", "kda")
EXPECTED_FORM = {
    "linear": "identity",
    "retnet": "scalar",
    "lightning": "scalar",
    "mamba2": "scalar",
    "gla": "diagonal",
    "delta_net": "dense",
    "gated_delta_net": "dense",
    "kda": "dense",
}


_CONSTRUCTORS = {name: jitted(getattr(la, name)) for name in ("retnet", "lightning", "mamba2", "gla", "delta_net", "kda")}
_CONSTRUCTORS["linear"] = jitted(la.linear_attention)
_CONSTRUCTORS["gated_delta_net"] = jitted(
    lambda q, k, v, key_heads, **gates: la.gated_delta_net(q[:, :key_heads], k[:, :key_heads], v, **gates))


def make_family(name: str, seed: int, length: int, heads: int, key_dim: int, value_dim: int, dtype=jnp.float32):
    """A LinearInputs for `name` with random projections and gates of realistic ranges."""
    rng = np.random.default_rng(seed)  # NumPy draws: no per-shape compilation in property tests
    normal = lambda shape, s=1.0: array(s * rng.standard_normal(shape), dtype)  # noqa: E731
    q = normal((length, heads, key_dim))
    k = normal((length, heads, key_dim))
    v = normal((length, heads, value_dim))
    build = _CONSTRUCTORS.get(name)
    if name == "linear":
        return build(q, k, v, scale=key_dim**-0.5)
    if name == "retnet":
        return build(q, k, v)
    if name == "lightning":
        return build(q, k, v, layer_factor=0.7)
    if name == "mamba2":
        groups = 1
        return build(
            v,
            normal((length, heads)),
            A_log=_log_linspace(1.0, 8.0, heads, dtype),
            dt_bias=normal((heads,), 0.5),
            B=normal((length, groups, key_dim)),
            C=normal((length, groups, key_dim)),
        )
    if name == "gla":
        gk = array(-np.logaddexp(0.0, -2.0 * rng.standard_normal((length, heads, key_dim))) / 4, dtype)
        return build(q, k, v, gk=gk)
    if name == "delta_net":
        return build(q, k, v, beta=array(1 / (1 + np.exp(-rng.standard_normal((length, heads)))), dtype))
    if name == "gated_delta_net":
        key_heads = 1 if heads % 2 else heads // 2  # exercise key heads repeated over value heads
        return build(
            q,
            k,
            v,
            key_heads,
            a=normal((length, heads)),
            b=normal((length, heads)),
            A_log=_log_linspace(0.5, 4.0, heads, dtype),
            dt_bias=normal((heads,), 0.5),
        )
    if name == "kda":
        return build(
            q,
            k,
            v,
            g_raw=normal((length, heads, key_dim)),
            A_log=_log_linspace(0.5, 4.0, heads, dtype),
            dt_bias=normal((heads * key_dim,), 0.5),
            b=normal((length, heads)),
        )
    raise ValueError(f"unknown family {name}")


def _log_linspace(start: float, stop: float, count: int, dtype):
    return array(np.log(np.linspace(start, stop, count)), dtype)


def slice_inputs(inputs: la.LinearInputs, start: int, stop: int) -> la.LinearInputs:
    """Tokens [start, stop) of a family's inputs, cut on the host (`array`): a slice on the device compiles a
    program for every new pair of bounds."""
    return jax.tree_util.tree_map(lambda x: array(np.asarray(x)[int(start) : int(stop)]), inputs)


def numpy_recurrence(inputs: la.LinearInputs, initial_state=None):
    """Independent float64 reference: the recurrence written out per token and head with NumPy."""
    q, k, v = (np.asarray(x, np.float64) for x in (inputs.q, inputs.k, inputs.v))
    length, heads, key_dim = k.shape
    g = None if inputs.g is None else np.asarray(inputs.g, np.float64)
    gk = None if inputs.gk is None else np.asarray(inputs.gk, np.float64)
    beta = None if inputs.beta is None else np.asarray(inputs.beta, np.float64)
    state = np.zeros((heads, key_dim, v.shape[-1])) if initial_state is None else np.array(initial_state, np.float64)
    out = np.zeros(v.shape)
    for t in range(length):
        for h in range(heads):
            transition = np.eye(key_dim)
            if gk is not None:
                transition = transition @ np.diag(np.exp(gk[t, h]))
            if g is not None:
                transition = transition * np.exp(g[t, h])
            strength = 1.0
            if beta is not None:
                transition = (np.eye(key_dim) - beta[t, h] * np.outer(k[t, h], k[t, h])) @ transition
                strength = beta[t, h]
            state[h] = transition @ state[h] + strength * np.outer(k[t, h], v[t, h])
            out[t, h] = inputs.scale * state[h].T @ q[t, h]
    return out, state


def rel_err(actual, expected) -> float:
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.linalg.norm(actual - expected) / max(np.linalg.norm(expected), 1e-30))
