"""Layers stacked by their repeating pattern, so that a forward compiles one group of layers and scans over it.

Hybrid models repeat a short pattern (Qwen3.5: three Gated DeltaNet layers and one gated attention layer, ten
times over). A forward written as a Python loop hands XLA one copy of the layer code per layer, and compile time
grows with the copies (`bench/layer_scan.py` compiles the shape-stable engine's programs both ways). Here:

* `LayerPlan.find` splits the layers into a head, `repeats` groups of `period` layers of identical structure, and
  a tail (any of them may be empty);
* `LayerStack` holds the parameters: head and tail layers as they are, each pattern position's layers stacked
  over the repeats (one array per leaf);
* `PoolStack` holds the cache pools the same way: one pool per head or tail layer, one flat pool
  [repeats * lead, ...] per pattern position (a layer's rows are those of its repeat's block);
* `run`, the one layer loop of every forward (plain, cached, decode, span programs, training), runs the head and
  the tail unrolled and the groups as one `lax.scan` whose body is one period. Per-layer caches of a stacked model
  are a `LayerStack` by the same plan, carried through the scan and updated in place, layer by layer; pools are
  read whole at each layer's base row.

What the scan body does not slice, and why. A `lax.scan` slices its stacked inputs per step; on a GPU a slice
that feeds a custom call (a Pallas kernel) is a copy.
* The routed experts (most of an MoE model's bytes) would be copied on every call. The body sees each pattern
  position's whole expert bank instead (`ExpertBank`: [repeats, E, ...] with the step's repeat index; a block-wise
  FP8 expert's values and scales each as a bank), and the grouped matmul offsets its expert ids into the bank.
* A pool slice would copy a layer's whole pool (gigabytes) per call. The body reads the flat pool, and the
  layer's base row (`repeat * lead`) is added to the layout's pool indices (`layout.shift_pool_rows`), in reads
  and in the rows it returns for writing.
The other weights (projections, norms, the router, shared experts) are sliced per step: a small share of a
layer's bytes.

The grouped-matmul kernel addresses its weights with int32 element offsets, so no bank may hold 2^31 elements or
more (the 35B-A3B shape's ten repeats of 256 experts hold 5.4e9). `LayerStack.build` stores such a position's
experts as chunks of whole repeats (`ExpertChunks`), each a separate array under the limit, and `with_experts`
hands the expert code every chunk and the index of the one holding the step's layer: the grouped matmul reads
that chunk in place (`grouped_matmul.ChunkedWeights`), so nothing is copied and the program has no conditional
(a `lax.switch` over the chunks would make the GPU wait for the host three times per scanned step). Expert code
that cannot choose a chunk itself runs under a `lax.switch`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Hashable, Sequence

import jax
import jax.numpy as jnp

__all__ = ["LayerPlan", "LayerStack", "PoolStack", "PoolRows", "PartSpec", "ExpertBank", "ExpertChunks",
           "EXPERT_LEAVES", "BANK_MAX_ELEMENTS", "run", "pool_writes", "map_outputs", "split_pairs", "stacked_like",
           "map_layers", "with_experts", "layer_signature"]

# Dict keys of per-layer parameters that hold routed experts ([E, in, out]); they stay whole in the scan
# (`ExpertBank`).
EXPERT_LEAVES = ("gate_up", "down")
# The most elements one stored bank of experts may hold: the grouped-matmul kernel's offsets are int32.
BANK_MAX_ELEMENTS = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """layers = head + period * repeats + tail. Parts (what `LayerStack` and `PoolStack` hold one of): each head
    layer, each pattern position (its `repeats` layers stacked), each tail layer."""

    layers: int
    head: int
    period: int = 0
    repeats: int = 0

    def __post_init__(self):
        if min(self.head, self.period, self.repeats) < 0 or self.tail < 0 or (self.period > 0) != (self.repeats > 0):
            raise ValueError(f"not a layer plan: {self}")

    @property
    def tail(self) -> int:
        return self.layers - self.head - self.period * self.repeats

    @property
    def parts(self) -> int:
        return self.head + self.period + self.tail

    @property
    def scanned(self) -> bool:
        return self.repeats > 1

    def members(self, part: int) -> int:
        """Layers a part holds: `repeats` for a pattern position, 1 otherwise."""
        return self.repeats if self.head <= part < self.head + self.period else 1

    def part(self, layer: int) -> tuple[int, int]:
        """(part, member) of layer `layer`."""
        if not 0 <= layer < self.layers:
            raise IndexError(f"layer {layer} out of range for {self.layers} layers")
        body = layer - self.head
        if body < 0:
            return layer, 0
        if body < self.period * self.repeats:
            return self.head + body % self.period, body // self.period
        return layer - self.period * (self.repeats - 1), 0

    def layer(self, part: int, member: int = 0) -> int:
        """The layer at (part, member)."""
        if part < self.head:
            return part
        if part < self.head + self.period:
            return self.head + member * self.period + (part - self.head)
        return part + self.period * (self.repeats - 1)

    @classmethod
    def unrolled(cls, layers: int) -> "LayerPlan":
        return cls(layers, head=layers)

    @classmethod
    def find(cls, signatures: Sequence[Hashable], *, min_repeats: int = 2) -> "LayerPlan":
        """The plan that leaves the fewest layers' code to compile (unrolled layers plus one period), among head
        lengths and periods whose pattern repeats at least `min_repeats` times; ties go to the shorter period.
        signatures: per layer, what must be equal for two layers to share code and stacked arrays."""
        sig = list(signatures)
        n = len(sig)
        best, cost = cls.unrolled(n), n
        for head in range(n):
            for period in range(1, (n - head) // 2 + 1):
                block = sig[head:head + period]
                repeats = 1
                while head + (repeats + 1) * period <= n and sig[head + repeats * period:
                                                                head + (repeats + 1) * period] == block:
                    repeats += 1
                if repeats < min_repeats:
                    continue
                c = n - period * repeats + period
                if c < cost or (c == cost and best.scanned and period < best.period):
                    best, cost = cls(n, head=head, period=period, repeats=repeats), c
        return best


def layer_signature(*parts: Any) -> tuple:
    """A hashable summary of PyTrees (their structure, shapes and dtypes) and plain values, for `LayerPlan.find`."""
    leaves, treedef = jax.tree.flatten(parts)
    return str(treedef), tuple((tuple(leaf.shape), str(leaf.dtype)) if hasattr(leaf, "shape") else repr(leaf)
                               for leaf in leaves)


@jax.tree_util.register_pytree_node_class
class ExpertChunks:
    """One pattern position's stacked experts [repeats, E, ...] stored as chunks of `per_chunk` repeats (the last
    may be shorter), each its own array of at most BANK_MAX_ELEMENTS elements."""

    def __init__(self, chunks, per_chunk: int):
        self.chunks, self.per_chunk = tuple(chunks), int(per_chunk)

    @property
    def shape(self) -> tuple[int, ...]:
        return (sum(c.shape[0] for c in self.chunks),) + tuple(self.chunks[0].shape[1:])

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def dtype(self):
        return self.chunks[0].dtype

    def __getitem__(self, repeat: int):
        return self.chunks[repeat // self.per_chunk][repeat % self.per_chunk]

    def tree_flatten(self):
        return self.chunks, self.per_chunk

    @classmethod
    def tree_unflatten(cls, per_chunk, chunks):
        return cls(chunks, per_chunk)


def _static_index(index) -> int | None:
    try:
        return int(index)
    except (TypeError, jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError):
        return None


@jax.tree_util.register_pytree_node_class
class ExpertBank:
    """The routed experts of one layer as a view into a pattern position's stacked experts: `bank` [repeats, E,
    ...] (an array, or `ExpertChunks`), `index` the layer's repeat (an int, or a traced int32 inside a scan).
    `with_experts` hands the bank to expert code without copying it; `materialize` copies the layer's experts out."""

    def __init__(self, bank, index):
        self.bank, self.index = bank, index

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.bank.shape[1:])

    @property
    def dtype(self):
        return self.bank.dtype

    def materialize(self):
        if not isinstance(self.bank, ExpertChunks):
            return jax.lax.dynamic_index_in_dim(self.bank, self.index, 0, keepdims=False)
        static = _static_index(self.index)
        if static is not None:
            return self.bank[static]
        per = self.bank.per_chunk
        index = jnp.asarray(self.index, jnp.int32)
        branches = [lambda i, c=c: jax.lax.dynamic_index_in_dim(c, i, 0, keepdims=False) for c in self.bank.chunks]
        return jax.lax.switch(index // per, branches, index % per)

    def tree_flatten(self):
        return (self.bank, self.index), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children)


def _flat_bank(bank):
    return bank.reshape((-1,) + tuple(bank.shape[2:]))


def with_experts(fn: Callable, *weights, max_elements: int | None = None, chunked_fn: Callable | None = None):
    """fn(*flat_weights, first): the expert code `fn` given each of `weights` as one array [n * E, ...] and the
    offset `first` of this layer's expert 0 in them, without copying a bank.

    weights: expert arrays [E, ...] (first 0), or `ExpertBank`s of one layer (same repeat, banks chunked alike).
    A bank stored as `ExpertChunks` runs `fn` on the chunk holding the layer when the index is static; for a
    traced index (a scan over layers) `chunked_fn(*chunks, chunk, first)` gets every chunk of each weight (tuples
    of flat arrays) and the chunk to read, to choose inside its own code, and without `chunked_fn` `fn` runs on
    the chunk chosen by `lax.switch` (a conditional: on a GPU the host waits to read its predicate). A bank over
    one array with more than `max_elements` elements (None: no limit) is copied out instead (`materialize`):
    only banks not built by `LayerStack.build` can be that large."""
    if not any(isinstance(w, ExpertBank) for w in weights):
        return fn(*weights, 0)
    if not all(isinstance(w, ExpertBank) for w in weights):
        raise ValueError("with_experts takes expert arrays or ExpertBanks, not a mix")
    chunked = [isinstance(w.bank, ExpertChunks) for w in weights]
    if not any(chunked):
        if max_elements is not None and any(w.bank.size > max_elements for w in weights):
            return fn(*[w.materialize() for w in weights], 0)
        experts = weights[0].bank.shape[1]
        return fn(*[_flat_bank(w.bank) for w in weights], jnp.asarray(weights[0].index, jnp.int32) * experts)
    if not all(chunked) or len({(w.bank.per_chunk, len(w.bank.chunks)) for w in weights}) != 1:
        raise ValueError("with_experts needs every bank chunked alike")
    per, experts = weights[0].bank.per_chunk, weights[0].bank.shape[1]
    chunks = list(zip(*[w.bank.chunks for w in weights]))
    static = _static_index(weights[0].index)
    if static is not None:
        return fn(*[_flat_bank(c) for c in chunks[static // per]], (static % per) * experts)
    index = jnp.asarray(weights[0].index, jnp.int32)
    if chunked_fn is not None:
        return chunked_fn(*[tuple(_flat_bank(c) for c in w.bank.chunks) for w in weights], index // per,
                          (index % per) * experts)
    branches = [lambda first, cs=cs: fn(*[_flat_bank(c) for c in cs], first) for cs in chunks]
    return jax.lax.switch(index // per, branches, (index % per) * experts)


def _leaf_key(path):
    """The last dict key of a leaf's path: the parameter's name, also for the arrays of a block-wise FP8 weight
    (`kernels.fp8.BlockFP8`), whose value and scale sit one level below it."""
    return next((k.key for k in reversed(path) if isinstance(k, jax.tree_util.DictKey)), None)


def _is_expert(path, stacked) -> bool:
    """A stacked part's leaf of routed experts: [repeats, E, in, out] under an EXPERT_LEAVES key (a dense MLP's
    "down" is [repeats, in, out]; an FP8 expert's value and scale alike), or its `ExpertChunks`."""
    return _leaf_key(path) in EXPERT_LEAVES and (isinstance(stacked, ExpertChunks) or getattr(stacked, "ndim", 0) == 4)


def _is_chunks(x) -> bool:
    return isinstance(x, ExpertChunks)


def _stack_part(members: list, consume: bool):
    """Stack per-layer trees; routed experts whose stack would exceed BANK_MAX_ELEMENTS go in `ExpertChunks` of
    whole repeats (one chunk size for every expert leaf of the part, FP8 values and scales included, so
    `with_experts` can pair them)."""
    def is_layer_expert(path, leaf):
        return _leaf_key(path) in EXPERT_LEAVES and getattr(leaf, "ndim", 0) == 3

    sizes = [leaf.size for path, leaf in jax.tree_util.tree_flatten_with_path(members[0])[0]
             if is_layer_expert(path, leaf)]
    per_chunk = max(1, BANK_MAX_ELEMENTS // max(sizes)) if sizes else len(members)

    def stack(path, *leaves):
        if per_chunk >= len(leaves) or not is_layer_expert(path, leaves[0]):
            return _stack(list(leaves), consume)
        return ExpertChunks([_stack(list(leaves[i:i + per_chunk]), consume)
                             for i in range(0, len(leaves), per_chunk)], per_chunk)

    return jax.tree_util.tree_map_with_path(stack, *members)


def _stack(leaves: list, consume: bool):
    out = jnp.stack(leaves)
    if consume:
        out.block_until_ready()  # one stacked leaf at a time: the peak stays one leaf above the model
        for leaf in leaves:
            if isinstance(leaf, jax.Array) and not leaf.is_deleted():
                leaf.delete()
    return out


@jax.tree_util.register_pytree_node_class
class LayerStack:
    """Per-layer parameters stored by `plan` (see the module docstring). Reads like the list of per-layer trees:
    `stack[i]`, `len`, iteration. `stack[i]` of a stacked layer slices its leaves (inside jit a static slice) and
    gives its routed experts as an `ExpertBank`."""

    def __init__(self, parts: tuple, plan: LayerPlan):
        self.parts, self.plan = tuple(parts), plan

    @classmethod
    def build(cls, layers: Sequence, plan: LayerPlan | None = None, *, consume: bool = False) -> "LayerStack":
        """Stack `layers` (per-layer trees) by `plan` (None: `LayerPlan.find` over their structures). consume:
        delete each layer's arrays once stacked (peak memory one leaf's worth above the model's, not double)."""
        if isinstance(layers, LayerStack):
            if plan is not None and plan != layers.plan:
                raise ValueError(f"the layers are stacked by {layers.plan}, not {plan}")
            return layers
        layers = list(layers)
        plan = plan or cls.plan_for(layers)
        if plan.layers != len(layers):
            raise ValueError(f"a plan for {plan.layers} layers given {len(layers)}")
        parts = []
        for part in range(plan.parts):
            members = [layers[plan.layer(part, m)] for m in range(plan.members(part))]
            if len(members) == 1:
                parts.append(members[0])
            else:
                parts.append(_stack_part(members, consume))
        return cls(tuple(parts), plan)

    @staticmethod
    def plan_for(layers: Sequence, extra: Sequence | None = None) -> LayerPlan:
        extra = extra if extra is not None else [None] * len(layers)
        return LayerPlan.find([layer_signature(layer, e) for layer, e in zip(layers, extra)])

    def __len__(self) -> int:
        return self.plan.layers

    def __getitem__(self, layer: int):
        part, member = self.plan.part(layer)
        tree = self.parts[part]
        if self.plan.members(part) == 1:
            return tree
        return jax.tree_util.tree_map_with_path(
            lambda path, a: ExpertBank(a, member) if _is_expert(path, a) else a[member], tree, is_leaf=_is_chunks)

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def tree_flatten(self):
        return (self.parts,), self.plan

    @classmethod
    def tree_unflatten(cls, plan, children):
        return cls(children[0], plan)


@dataclasses.dataclass(frozen=True)
class PartSpec:
    """One part of a `PoolStack`: its kind ("slot": a row per entry; "token": a row per cached token), how many
    layers it holds, and the rows per layer (`lead`): layer `member`'s rows are [member * lead, (member+1) * lead)."""

    kind: str
    members: int
    lead: int


@jax.tree_util.register_pytree_node_class
class PoolStack:
    """Cache pools stored by a `LayerPlan`: per part a tree of arrays [members * lead, ...]. The part specs are
    static (the tree's aux data), so a stand-in with fewer rows (`segment_mesh`) still yields the real rows."""

    def __init__(self, parts: tuple, specs: tuple[PartSpec, ...], plan: LayerPlan):
        self.parts, self.specs, self.plan = tuple(parts), tuple(specs), plan

    def layer(self, layer: int) -> tuple[Any, PartSpec, int]:
        """(the part's pool tree, its spec, the layer's base row) of a layer that is not scanned."""
        part, member = self.plan.part(layer)
        spec = self.specs[part]
        return self.parts[part], spec, member * spec.lead

    def replace(self, parts) -> "PoolStack":
        return PoolStack(tuple(parts), self.specs, self.plan)

    def tree_flatten(self):
        return (self.parts,), (self.specs, self.plan)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(children[0], *aux)


Step = Callable[..., tuple[Any, tuple[Any, Any]]]


def _split_experts(tree):
    """(tree with expert leaves None, tree with only the expert leaves) of a stacked part."""
    sliced = jax.tree_util.tree_map_with_path(lambda p, a: None if _is_expert(p, a) else a, tree, is_leaf=_is_chunks)
    banks = jax.tree_util.tree_map_with_path(lambda p, a: a if _is_expert(p, a) else None, tree, is_leaf=_is_chunks)
    return sliced, banks


def _merge(sliced, banks, index):
    return jax.tree.map(lambda s, b: ExpertBank(b, index) if b is not None else s, sliced, banks,
                        is_leaf=lambda x: x is None)


def _flatten_members(tree):
    """Leaves [members, n, ...] -> [members * n, ...]."""
    return jax.tree.map(lambda a: a.reshape((-1,) + tuple(a.shape[2:])), tree)


@dataclasses.dataclass(frozen=True)
class PoolRows:
    """A layer's view of its pools in a `run` over a `PoolStack`: its part's pool tree and the layer's base row
    there (0 for an unrolled layer; `member * lead` inside the scan)."""

    tree: Any
    base: Any


def _member(stacked, g):
    """Layer g's cache out of its pattern position's stacked caches: a view into the stack where the cache type
    offers one (`member_view`, e.g. a `base.KVCache` of several rows: written and read in place), else a copy of
    the member."""
    view = stacked.member_view(g) if hasattr(stacked, "member_view") else None
    if view is not None:
        return view
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, g, 0, keepdims=False), stacked)


def _put_member(stacked, tree, g):
    """The stack with layer g's new cache: a view's own stack (already written), else the member written back."""
    if hasattr(tree, "stacked"):
        return tree.stacked()
    return jax.tree.map(lambda a, t: jax.lax.dynamic_update_index_in_dim(a, t.astype(a.dtype), g, 0), stacked, tree)


def run(step: Step, carry, layers: LayerStack | Sequence, *, caches: LayerStack | Sequence | None = None,
        pools: PoolStack | Sequence | None = None) -> tuple[Any, Any, Any]:
    """The one layer loop of every forward: `step(i, layer, params, cache, pool, carry) -> (carry, (cache, out))`
    for each layer in order, where `i` is a representative layer index with the layer's structure (for its static
    choices: its type), `layer` the layer's own index (an int, or a traced int32 in the scan), `cache` its cache
    (None without `caches`) and `pool` its `PoolRows` (None without `pools`). The step returns the layer's new
    cache (None when it keeps none) and any other per-layer output (None for none).

    The plan comes from `pools` (a `PoolStack`), else from `layers` (a `LayerStack`); per-layer lists run every
    layer unrolled. Head and tail layers run unrolled, the groups as one `lax.scan` over the stacked parameters
    (routed experts closed over as `ExpertBank`s, pools read whole at the layer's base row).

    Caches are carried through the scan and each layer's new cache is written back into its member (same shapes;
    dtypes cast to the stack's): scanned in as inputs and out as outputs they would be a second copy of every
    cache, while a carried stack stays in the buffers a donated decode cache came in. Without caches the new ones
    (if any) are the scan's outputs.

    Returns (carry, the new caches, the outputs). Caches come back in the form given: a `LayerStack` by the same
    plan for one (or for None, when the plan scans), a tuple for a sequence (stacked and unstacked around the scan
    when the plan scans: pass `stacked_like` caches to a repeated step instead). Outputs are a `LayerStack` by the
    plan when it scans (a scanned part's outputs stacked over its members, the form a decode step takes caches in),
    else a tuple, one per layer."""
    if pools is not None and not isinstance(pools, PoolStack):  # per-layer pools: every layer unrolled
        pools = PoolStack(tuple(pools), (None,) * len(pools), LayerPlan.unrolled(len(pools)))
    if pools is not None:
        plan = pools.plan
    elif isinstance(layers, LayerStack) and layers.plan.scanned:
        plan = layers.plan
    else:
        plan = LayerPlan.unrolled(len(layers))
    if isinstance(layers, LayerStack) and plan.scanned and layers.plan != plan:
        raise ValueError(f"parameters stacked by {layers.plan} but pools by {plan}")
    if pools is not None and plan.scanned and not isinstance(layers, LayerStack):
        layers = LayerStack.build(layers, plan)
    given = caches
    if caches is None:
        caches = (None,) * plan.parts if not plan.scanned else LayerStack((None,) * plan.parts, plan)
    elif plan.scanned:
        caches = LayerStack.build(caches, plan)
        if caches.plan != plan:
            raise ValueError(f"parameters stacked by {plan} but caches by {caches.plan}")
    parts = caches.parts if isinstance(caches, LayerStack) and plan.scanned else tuple(caches)
    new: list = [None] * plan.parts
    outs: list = [None] * plan.parts

    def unrolled(part: int, carry):
        i = plan.layer(part)
        pool = None if pools is None else PoolRows(pools.parts[part], 0)
        carry, (new[part], outs[part]) = step(i, i, layers[i], parts[part], pool, carry)
        return carry

    for part in range(plan.head):
        carry = unrolled(part, carry)
    if plan.period:
        body_parts = range(plan.head, plan.head + plan.period)
        split = [_split_experts(layers.parts[p]) for p in body_parts]

        def body(state, xs):
            carry, held = state  # per pattern position its stacked caches (None: none given)
            g, sliced = xs
            held, made = list(held), []
            for j, part in enumerate(body_parts):
                params = _merge(sliced[j], split[j][1], g)
                cache = None if held[j] is None else _member(held[j], g)
                pool = None if pools is None else PoolRows(pools.parts[part], g * pools.specs[part].lead)
                carry, (cache, out) = step(plan.layer(part), plan.head + g * plan.period + j, params, cache, pool,
                                           carry)
                if held[j] is None:
                    made.append((cache, out))
                else:
                    held[j] = _put_member(held[j], cache, g)
                    made.append((None, out))
            return (carry, tuple(held)), tuple(made)

        members = jnp.arange(plan.repeats, dtype=jnp.int32)
        held = tuple(parts[p] for p in body_parts)
        (carry, held), made = jax.lax.scan(body, (carry, held), (members, tuple(s for s, _ in split)))
        for j, part in enumerate(body_parts):
            new[part] = made[j][0] if held[j] is None else held[j]
            outs[part] = made[j][1]
    for part in range(plan.head + plan.period, plan.parts):
        carry = unrolled(part, carry)
    outputs = LayerStack(tuple(outs), plan) if plan.scanned else tuple(outs)
    if not plan.scanned:
        caches_out = LayerStack.build(new, given.plan) if isinstance(given, LayerStack) else tuple(new)
    else:
        stacked = LayerStack(tuple(new), plan)
        caches_out = tuple(stacked) if given is not None and not isinstance(given, LayerStack) else stacked
    return carry, caches_out, outputs


def pool_writes(outputs) -> tuple:
    """Per pool part its `stitch.RowWrites`, out of `run`'s outputs over a `PoolStack` (a scanned part's writes,
    stacked over its members, flattened into one list of rows)."""
    from hypic_jax.stitch import RowWrites

    if not isinstance(outputs, LayerStack):
        return tuple(outputs)
    plan = outputs.plan
    return tuple(w if plan.members(p) == 1 else RowWrites(w.rows.reshape(-1), _flatten_members(w.values))
                 for p, w in enumerate(outputs.parts))


def map_outputs(fn: Callable[[Any], Any], outputs):
    """`fn` on every part's outputs of `run` (a `LayerStack` or a tuple), keeping the form."""
    if isinstance(outputs, LayerStack):
        return LayerStack(tuple(fn(o) for o in outputs.parts), outputs.plan)
    return tuple(fn(o) for o in outputs)


def split_pairs(outputs):
    """Per-layer outputs that are pairs (a, b) (a `LayerStack` by a plan, or a tuple per layer, as `run` returns
    them) as (the a's in the same form, the b's stacked in layer order [layers, ...])."""
    if isinstance(outputs, LayerStack):
        firsts = LayerStack(tuple(part[0] for part in outputs.parts), outputs.plan)
        seconds = [outputs[i][1] for i in range(len(outputs))]
    else:
        firsts, seconds = tuple(o[0] for o in outputs), [o[1] for o in outputs]
    return firsts, jnp.stack(seconds)


def _scanned(layers) -> bool:
    return isinstance(layers, LayerStack) and layers.plan.scanned


def stacked_like(layers, caches):
    """Per-layer `caches` (a sequence, or a `LayerStack`) in the form a forward over `layers` keeps them: stacked
    by their plan when `layers` are a scanned `LayerStack`, else a tuple."""
    if _scanned(layers):
        return LayerStack.build(caches, layers.plan)
    return tuple(caches)


def map_layers(fn: Callable[[int, Any], Any], caches):
    """`fn(i, cache)` on every layer's cache of `caches` (a sequence, or a `LayerStack`) in the same form: a stacked
    part through `jax.vmap` (i is then a representative layer index, for static choices such as the layer's type)."""
    if not isinstance(caches, LayerStack):
        return tuple(fn(i, c) for i, c in enumerate(caches))
    plan = caches.plan
    parts = [fn(plan.layer(p), tree) if plan.members(p) == 1 else jax.vmap(functools.partial(fn, plan.layer(p)))(tree)
             for p, tree in enumerate(caches.parts)]
    return LayerStack(tuple(parts), plan)


def pool_stack(layers: Sequence[tuple[str, Any]], plan: LayerPlan, *, slots: int, rows: int,
               make: Callable[[tuple[int, ...], Any], Any] | None = None) -> PoolStack:
    """Zero pools for per-layer pieces `layers` ((kind, tree of per-entry or per-token ShapeDtypeStruct)),
    stored by `plan`: `slots` rows per layer for "slot" pieces, `rows` for "token" pieces. make(shape, dtype)
    allocates (default jnp.zeros)."""
    make = make or (lambda shape, dtype: jnp.zeros(shape, dtype))
    parts, specs = [], []
    for part in range(plan.parts):
        members = plan.members(part)
        kinds = {layers[plan.layer(part, m)][0] for m in range(members)}
        if len(kinds) != 1:
            raise ValueError(f"part {part} mixes pool kinds {sorted(kinds)}")
        kind, tree = layers[plan.layer(part)]
        lead = slots if kind == "slot" else rows
        parts.append(jax.tree.map(lambda a: make((members * lead,) + tuple(a.shape), a.dtype), tree))
        specs.append(PartSpec(kind, members, lead))
    return PoolStack(tuple(parts), tuple(specs), plan)

