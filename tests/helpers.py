"""What the test modules share, in one plain module: the relative error, the builder of tiny checkpoints of every
architecture, random inputs of every linear-attention family with a float64 NumPy reference, random span layouts,
and the guards that keep the suite fast (`jitted`, `examples`, `trim_compiled_programs`, xdist groups).

Why a module and not conftest.py: pytest loads conftest.py itself, as a plugin, and it is not meant to be imported
(a second conftest.py in a subfolder would make the name ambiguous), while test modules, conftest.py and the
scripts the tests run in subprocesses (`sys.path.insert(0, tests)`) can all import `helpers` by name. Pytest
fixtures live in conftest.py; everything else a test calls lives here, so that no test module imports another.

Sections: relative error; xdist groups; tiny checkpoints; compiled programs and property tests; linear-attention
families; random span layouts.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import gc
import json
import os
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, settings

from hypic_jax.core import linear_attn as la
from hypic_jax.core.linear_attn import Summary
from hypic_jax.stitch import layout as lay


# -----------------------------------------------------------------------------------------------------------------
# Relative error


def rel_err(actual, expected, norm: str = "l2", floor: float = 1e-30) -> float:
    """||actual - expected|| / max(||expected||, floor), in float64; 0 for empty arrays.

    `norm="l2"` (the Frobenius norm of the whole array) measures the error of the result as a whole, and is what
    kernel-against-reference checks use. `norm="max"` (largest absolute entry) bounds the worst single entry by
    the largest one: logits and engine outputs, where one wrong row must not hide in the norm of many right ones.
    `floor` keeps an all-zero `expected` from dividing by zero (the result then is the absolute error); a larger
    floor measures the error on a known scale instead of the expected value's own (`transfer_err` in
    test_linear_attn.py). A NaN anywhere gives NaN, which fails every `<` or `<=` bound."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    if not expected.size:
        return 0.0
    if norm == "l2":
        size = lambda x: np.linalg.norm(x.ravel())  # noqa: E731
    elif norm == "max":
        size = lambda x: np.max(np.abs(x))  # noqa: E731
    else:
        raise ValueError(f"norm is 'l2' or 'max', not {norm!r}")
    return float(size(actual - expected) / np.maximum(size(expected), floor))


# -----------------------------------------------------------------------------------------------------------------
# xdist groups


def on_worker_of(group: str):
    """Tests of one tiny checkpoint share it and their compiled programs (module-scoped, and JAX's caches): under
    xdist (`--dist loadgroup`, pyproject.toml) they run on one worker, which builds and compiles them once."""
    return pytest.mark.xdist_group(group)


LONG = pytest.mark.long  # tens of seconds (a subprocess, or engines warmed up): scheduled first (conftest.py)


ARCHS = ("qwen_dense", "qwen_moe", "ring", "kimi")  # the engine tests' checkpoints (`tiny_checkpoint`)


def arch_params(module: str, archs=ARCHS) -> list:
    """`archs` as parameters, each architecture's tests in a group of their own (`on_worker_of`)."""
    return [pytest.param(arch, marks=on_worker_of(f"{module}-{arch}")) for arch in archs]


def primitives_outside_kernels(jaxpr) -> set[str]:
    """Primitive names of a jaxpr and its sub-jaxprs, except inside Pallas kernels (whose `pl.when` are
    conditionals of the kernel's own, on the device)."""
    from jax.extend.core import jaxprs_in_params

    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        if eqn.primitive.name != "pallas_call":
            for sub in jaxprs_in_params(eqn.params):
                names |= primitives_outside_kernels(sub)
    return names


# -----------------------------------------------------------------------------------------------------------------
# Tiny checkpoints
#
# `reference_model(arch)` builds a seeded random model of `arch` in the architecture's reference library
# (transformers for Qwen3.5, Qwen3-Next and Kimi-Linear, mlx-lm for Ring-linear), `save_checkpoint` writes it as a
# Hugging Face folder, and `tiny_checkpoint` loads that with `hypic_jax.load` for the engine tests. Sizes are the
# smallest that still exercise every feature of the architecture; every parameter a zero or one init would leave
# inert (norms, gates, biases) is perturbed, so a mix-up shows.

VOCAB = 128  # Qwen and Kimi; Ring's is RING_CONFIG["vocab_size"]

# Qwen3.5 / Qwen3-Next: 2 layers (GDN, then full attention; the multimodal wrapper keeps the default 4-layer pattern
# to check `layer_types` defaults), 2 key heads repeated to 4 value heads, GQA 4/2, partial RoPE (8 of 32 dims),
# 8 experts top-2 with a shared expert.
QWEN = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_hidden_layers=2,
    layer_types=["linear_attention", "full_attention"],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    initializer_range=0.05,
)
QWEN_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)

# Kimi-Linear: a KDA layer, a NoPE MLA layer (low-rank q), a dense first MLP and group-routed MoE layers.
KIMI = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    layer_types=["linear_attention", "full_attention", "linear_attention"],
    mlp_layer_types=["dense", "sparse", "sparse"],
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=24,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    linear_num_heads=4,
    linear_head_dim=16,
    num_local_experts=8,
    num_experts_per_tok=2,
    n_group=4,
    topk_group=2,
    initializer_range=0.08,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=None,  # a tiny random model emits eos as readily as any token; decode never stops early
)

# Ring-linear-2.0: both layer types, both MLP kinds, grouped routing, a shared expert, partial RoPE, non-trivial GQA.
RING_CONFIG = {
    "architectures": ["BailingMoeLinearV2ForCausalLM"],
    "model_type": "bailing_moe_linear",
    "vocab_size": 96,
    "hidden_size": 64,
    "intermediate_size": 96,
    "max_position_embeddings": 4096,
    "num_hidden_layers": 6,
    "layer_group_size": 3,  # layers 2 and 5 are full attention
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "group_norm_size": 2,
    "partial_rotary_factor": 0.5,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "rms_norm_eps": 1e-6,
    "use_qk_norm": True,
    "use_qkv_bias": False,
    "use_bias": False,
    "tie_word_embeddings": False,
    "first_k_dense_replace": 1,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "num_shared_experts": 1,
    "moe_shared_expert_intermediate_size": 32,
    "moe_router_enable_expert_bias": True,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "score_function": "sigmoid",
    "n_group": 4,
    "topk_group": 2,
}

REFERENCE_ARCHS = ("qwen_dense", "qwen_moe", "qwen_moe_wrapper", "qwen_next", "kimi", "ring")  # `reference_model`


def reference_model(arch: str, seed: int = 0, without: tuple[str, ...] = (), **overrides):
    """A seeded random float32 model of `arch` (REFERENCE_ARCHS) in its reference library: a transformers
    `torch.nn.Module` in eval mode, or for "ring" an mlx-lm model. `overrides` replace entries of the architecture's
    Hugging Face config, and the keys in `without` are left out (the library's default applies)."""

    def config(base: dict) -> dict:
        return {k: v for k, v in {**base, **overrides}.items() if k not in without}

    if arch == "ring":
        return _ring_reference(config(RING_CONFIG), seed)
    pytest.importorskip("transformers")
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    if arch == "kimi":
        model = tf.KimiLinearForCausalLM(tf.KimiLinearConfig(**config(KIMI))).eval()
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.add_(0.2 * torch.randn_like(param))
            for layer in model.model.layers:
                if hasattr(layer.mlp, "gate"):
                    layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.1)
        return model
    if arch == "qwen_dense":
        model = tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(**config({**QWEN, "intermediate_size": 96})))
    elif arch == "qwen_moe":
        model = tf.Qwen3_5MoeForCausalLM(tf.Qwen3_5MoeTextConfig(**config({**QWEN, **QWEN_MOE})))
    elif arch == "qwen_moe_wrapper":
        text = config({**QWEN, **QWEN_MOE, "num_hidden_layers": 4, "layer_types": None})
        model = tf.Qwen3_5MoeForConditionalGeneration(tf.Qwen3_5MoeConfig(
            text_config=text,
            vision_config=dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32, out_hidden_size=64)))
    elif arch == "qwen_next":
        model = tf.Qwen3NextForCausalLM(tf.Qwen3NextConfig(**config({**QWEN, **QWEN_MOE, "intermediate_size": 96})))
    else:
        raise ValueError(f"unknown architecture {arch!r}; choose one of {REFERENCE_ARCHS}")
    model = model.float()
    torch.manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.eval()


def _ring_reference(hf_config: dict, seed: int):
    mx = pytest.importorskip("mlx.core")
    mlx_ring = pytest.importorskip("mlx_lm.models.bailing_moe_linear")
    from mlx.utils import tree_flatten

    mx.random.seed(1234 + seed)
    model = mlx_ring.Model(mlx_ring.ModelArgs.from_dict(hf_config))
    rng = np.random.default_rng(1234 + seed)
    updates = []
    for name, value in tree_flatten(model.parameters()):
        if "norm" in name:
            updates.append((name, mx.array(1.0 + 0.2 * rng.standard_normal(value.shape), dtype=mx.float32)))
        elif name.endswith("expert_bias"):
            updates.append((name, mx.array(0.1 * rng.standard_normal(value.shape), dtype=mx.float32)))
    model.load_weights(updates, strict=False)
    mx.eval(model.parameters())
    model.hf_config = json.dumps(hf_config)  # a string: an attribute of the module, not one of its parameters
    return model


def _mlx_to_hf_names(weights: dict[str, np.ndarray], num_experts: int) -> dict[str, np.ndarray]:
    """Undo mlx-lm's sanitize: stacked `switch_mlp` experts -> per-expert tensors, `gate.gate_proj` -> `gate`."""
    out = {}
    for name, value in weights.items():
        if ".mlp.switch_mlp." in name:
            prefix, rest = name.split(".mlp.switch_mlp.")
            for e in range(num_experts):
                out[f"{prefix}.mlp.experts.{e}.{rest}"] = np.ascontiguousarray(value[e])
        elif name.endswith(".mlp.gate.gate_proj.weight"):
            out[name.replace(".mlp.gate.gate_proj.weight", ".mlp.gate.weight")] = value
        else:
            out[name] = value
    return out


def save_checkpoint(model, folder, **kwargs) -> Path:
    """`model` (`reference_model`) written into `folder` as a Hugging Face checkpoint; `kwargs` go to
    transformers' `save_pretrained` (`max_shard_size=`, ...). An mlx-lm Ring model is written with the Hugging Face
    names of the released remote-code model (mlx-lm renames two of them in `sanitize`; this undoes that)."""
    folder = Path(folder)
    if hasattr(model, "save_pretrained"):
        model.save_pretrained(folder, **kwargs)
        return folder
    from mlx.utils import tree_flatten
    from safetensors.numpy import save_file

    config = json.loads(model.hf_config)
    weights = {k: np.array(v, dtype=np.float32) for k, v in tree_flatten(model.parameters())}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(_mlx_to_hf_names(weights, config["num_experts"]), str(folder / "model.safetensors"))
    return folder


def prompt(batch: int = 2, length: int = 24, seed: int = 0) -> np.ndarray:
    """Random tokens of the Qwen and Kimi vocabulary."""
    return np.random.RandomState(seed).randint(0, VOCAB, (batch, length)).astype(np.int32)


def reference_logits(model, tokens: np.ndarray) -> np.ndarray:
    """A transformers model's float32 logits of `tokens` (batch, length)."""
    import torch

    with torch.no_grad():
        return model(input_ids=torch.tensor(np.asarray(tokens), dtype=torch.long)).logits.float().numpy()


def reference_greedy(model, tokens: np.ndarray, new_tokens: int) -> np.ndarray:
    """A transformers model's greedy continuation of `tokens`: exactly `new_tokens` more."""
    import torch

    with torch.no_grad():
        out = model.generate(
            torch.tensor(tokens, dtype=torch.long),
            attention_mask=torch.ones(tokens.shape, dtype=torch.long),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return out[:, tokens.shape[1] :].numpy()


SLOW_DECAY = float(np.log(0.05))  # A_log of linear layers: long memory, so a dropped transfer T shows


def slow_decay(params):
    """Every linear layer's A_log set to a slow decay (random-init gates forget within a few tokens, which would
    hide a dropped transfer operator)."""

    def visit(tree):
        if isinstance(tree, dict):
            return {k: (jnp.full_like(v, SLOW_DECAY) if k == "A_log" else visit(v)) for k, v in tree.items()}
        if isinstance(tree, (list, tuple)):
            return type(tree)(visit(v) for v in tree)
        return tree

    return visit(params)


_TINY = {"qwen_dense": {}, "qwen_moe": {}, "kimi": {}, "ring": {"num_hidden_layers": 3}}  # ring: linear, linear, full


@functools.lru_cache(maxsize=None)
def copy_folder(src: Path, dst: Path) -> Path:
    """A copy of a checkpoint folder, to damage or edit."""
    import shutil

    shutil.copytree(src, dst)
    return dst


def rewrite_safetensors(folder: Path, edit, *, framework: str = "numpy") -> None:
    """Apply edit(dict name -> array) to a single-file checkpoint's tensors, as numpy arrays or ("pt") torch
    tensors (float8 tensors need torch: safetensors' numpy side has no float8)."""
    import importlib

    io = importlib.import_module(f"safetensors.{'torch' if framework == 'pt' else 'numpy'}")
    load_file, save_file = io.load_file, io.save_file
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def tiny_checkpoint(arch: str, folder: str):
    """(model with slow decays, vocabulary size, folder) of a tiny random checkpoint of `arch` (ARCHS) written into
    `folder` and loaded in float32; built once per (arch, folder) in a process (conftest's `tiny_checkpoints`
    fixture shares one folder per architecture)."""
    if arch not in _TINY:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose one of {tuple(_TINY)}")
    return load_tiny(arch, save_checkpoint(reference_model(arch, **_TINY[arch]), folder))


def load_tiny(arch: str, folder):
    """`tiny_checkpoint`'s answer for a `folder` it already wrote: a subprocess given the folder loads it without
    importing the reference libraries (seconds per process)."""
    import hypic_jax

    vocab = RING_CONFIG["vocab_size"] if arch == "ring" else VOCAB
    model = hypic_jax.load(folder, dtype="float32")
    return model.replace(params=slow_decay(model.params)), vocab, Path(folder)


# -----------------------------------------------------------------------------------------------------------------
# Compiled programs and property tests


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


# -----------------------------------------------------------------------------------------------------------------
# Linear-attention families: random inputs through the core's public constructors, and an independent
# float64 NumPy token-by-token recurrence to check them against

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


def numpy_recurrence(inputs: la.LinearInputs, initial_state=None, *, magnitude: bool = False):
    """Independent float64 reference: the recurrence written out per token and head with NumPy.

    With `magnitude`, also the size of the terms each output row sums, |scale| ||S_t|| ||q_t|| per token and head:
    float32 rounding of an output is proportional to it, not to the output itself, which can be a cancellation
    (a small sum of large terms)."""
    q, k, v = (np.asarray(x, np.float64) for x in (inputs.q, inputs.k, inputs.v))
    length, heads, key_dim = k.shape
    g = None if inputs.g is None else np.asarray(inputs.g, np.float64)
    gk = None if inputs.gk is None else np.asarray(inputs.gk, np.float64)
    beta = None if inputs.beta is None else np.asarray(inputs.beta, np.float64)
    state = np.zeros((heads, key_dim, v.shape[-1])) if initial_state is None else np.array(initial_state, np.float64)
    out = np.zeros(v.shape)
    sizes = np.zeros((length, heads))
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
            sizes[t, h] = abs(inputs.scale) * np.linalg.norm(state[h]) * np.linalg.norm(q[t, h])
    return (out, state, sizes) if magnitude else (out, state)


# -----------------------------------------------------------------------------------------------------------------
# Random span layouts: requests of every program kind at one small capacity, the GDN / KDA inputs and pool they
# run on, and the layout core through either implementation (test_stable_kernels.py, and on a model axis
# test_model_axis.py)

LAYOUT_HEADS = (2, 4, 16, 16)  # key heads, value heads, key dim, value dim
LAYOUT_CAP = lay.Capacity(tokens=96, pieces=10, keys=192, records=10, chunk=16, conv=3)
LAYOUT_SLOTS = 6


def random_spans(rng, kind: str) -> list[lay.Span]:
    """A random request of this program kind that fits LAYOUT_CAP: cold (fresh spans cut at a seam, recorded),
    plain (cached prefix snapshots, then fresh spans, some recorded), pic (fresh seams and cached interiors, a
    query)."""
    budget = LAYOUT_CAP.tokens - 4
    spans, fresh, slot = [], 0, 0
    if kind == "plain":
        for _ in range(int(rng.integers(0, 3))):
            n = int(rng.integers(1, 30))
            spans.append(lay.Span(lay.CACHED, n, canonical_start=0, slot=int(rng.integers(1, LAYOUT_SLOTS)),
                                  kv_rows=np.zeros(n, np.int32), snapshot=True))
    count = int(rng.integers(1, 5))
    for i in range(count):
        n = int(rng.integers(1, 40))
        if fresh + n > budget:
            break
        if kind == "cold":
            cut = int(rng.integers(0, min(n, 9)))
            spans.append(lay.Span(lay.FRESH, n, record_from=cut, record_slot=slot, record_rows=np.zeros(n - cut,
                                                                                                          np.int32)))
            slot += 1
            fresh += n
        elif kind == "plain":
            record = bool(rng.integers(2))
            spans.append(lay.Span(lay.FRESH, n, record_from=0 if record else None, record_slot=slot,
                                  record_rows=np.zeros(n, np.int32) if record else None))
            slot += record
            fresh += n
        else:  # pic: a seam (maybe none), then a cached interior
            seam = int(rng.integers(0, 6))
            if seam and fresh + seam <= budget:
                spans.append(lay.Span(lay.FRESH, seam))
                fresh += seam
            spans.append(lay.Span(lay.CACHED, n, canonical_start=seam, slot=int(rng.integers(1, LAYOUT_SLOTS)),
                                  kv_rows=np.zeros(n, np.int32)))
    if kind != "cold":
        q = int(rng.integers(1, 4))
        spans.append(lay.Span(lay.FRESH, q))
        fresh += q
    return spans


def random_layout(rng, kind: str) -> tuple[list[lay.Span], lay.LayoutArrays]:
    """A random request of this program kind (`random_spans`) and its layout at LAYOUT_CAP (a pic request's cached
    transfers dropped at random: HYPIC's `addition`)."""
    spans = random_spans(rng, kind)
    n_fresh = sum(s.length for s in spans if s.kind == lay.FRESH)
    arrays = lay.build(spans, LAYOUT_CAP, isolated=kind == "cold", tokens=np.zeros(n_fresh, np.int32),
                       summaries=kind != "plain", transfer=bool(rng.integers(2)) or kind != "pic")
    return spans, arrays


def layout_inputs(rng, per_key: bool) -> la.LinearInputs:
    """GDN inputs (per_key: KDA's, as many key heads as value heads) of LAYOUT_CAP's tokens."""
    hk, h, k_dim, v_dim = LAYOUT_HEADS
    f = LAYOUT_CAP.tokens
    q = jnp.asarray(rng.standard_normal((f, hk, k_dim)), jnp.float32)
    k = la.l2_normalize(jnp.asarray(rng.standard_normal((f, hk, k_dim)), jnp.float32))
    v = jnp.asarray(rng.standard_normal((f, h, v_dim)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0.1, 0.9, (f, h)), jnp.float32)
    if per_key:  # KDA: per-key gates, as many key heads as value heads
        q, k = jnp.repeat(q, h // hk, 1), jnp.repeat(k, h // hk, 1)
        gk = -jnp.asarray(rng.uniform(0.01, 0.4, (f, h, k_dim)), jnp.float32)
        return la.LinearInputs(q, k, v, gk=gk, beta=beta, scale=k_dim**-0.5)
    g = -jnp.asarray(rng.uniform(0.01, 0.4, (f, h)), jnp.float32)
    return la.LinearInputs(q, k, v, g=g, beta=beta, scale=k_dim**-0.5)


def layout_pool(rng) -> Summary:
    """A dense summary pool of LAYOUT_SLOTS random states and transfers near the identity."""
    _, h, k_dim, v_dim = LAYOUT_HEADS
    state = jnp.asarray(rng.standard_normal((LAYOUT_SLOTS, h, k_dim, v_dim)), jnp.float32)
    transfer = (jnp.eye(k_dim) * 0.7
                + 0.3 * jnp.asarray(rng.standard_normal((LAYOUT_SLOTS, h, k_dim, k_dim)), jnp.float32) / k_dim**0.5)
    return Summary("dense", state, transfer)


@functools.partial(jax.jit, static_argnames=("summaries", "isolated", "impl"))
def layout_core(inputs, pool, arrays, *, summaries, isolated, impl):
    """`stitch.linear_over_layout` through `impl` ("xla" or "pallas") and the records it makes: (outputs, final
    state, piece end states, piece summaries, records)."""
    from hypic_jax import stitch  # the kernels' imports only where a test runs them
    from hypic_jax.kernels import gdn

    config = gdn.GDNConfig(chunk=16, block_v=16, solve="doubling" if inputs.gk is not None else "tile",
                           transfer_group=0)
    result = stitch.linear_over_layout(inputs, pool, arrays, summaries=summaries, impl=impl, kernel_config=config)
    records = stitch.record_summaries(result, arrays, isolated=isolated, pool=pool)
    return result.outputs, result.final_state, result.piece_ends, result.piece_summaries, records


def schedule_all(scheduler, specs, *, timeout: float = 120, **request) -> list[list[dict]]:
    """Every (segments, `SamplingParams`) of `specs` submitted at once to `scheduler` (a `Request` with `request`'s
    fields), the scheduler's thread started here and stopped once each request has its `done` or `error` event;
    returns each request's events."""
    import threading

    from hypic_jax.engine.scheduler import Request

    done, events = threading.Event(), [[] for _ in specs]

    def sink(k):
        def put(event):
            events[k].append(event)
            if sum(e["type"] in ("done", "error") for es in events for e in es) == len(specs):
                done.set()
        return put

    scheduler.start()
    try:
        for k, (segments, params) in enumerate(specs):
            scheduler.submit(Request(segments, params, sink(k), **request))
        assert done.wait(timeout), "the scheduler did not answer every request in time"
    finally:
        scheduler.stop()
    return events
