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
* `run` runs the head and the tail unrolled and the groups as one `lax.scan` whose body is one period.

What the scan body does not slice, and why. A `lax.scan` slices its stacked inputs per step; on a GPU a slice
that feeds a custom call (a Pallas kernel) is a copy.
* The routed experts (most of an MoE model's bytes) would be copied on every call. The body sees each pattern
  position's whole expert bank instead (`ExpertBank`: [repeats, E, ...] with the step's repeat index), and the
  grouped matmul offsets its expert ids into the bank.
* A pool slice would copy a layer's whole pool (gigabytes) per call. The body reads the flat pool, and the
  layer's base row (`repeat * lead`) is added to the layout's pool indices (`layout.shift_pool_rows`), in reads
  and in the rows it returns for writing.
The other weights (projections, norms, the router, shared experts) are sliced per step: a small share of a
layer's bytes. A bank past int32 element offsets is still sliced (`layers.grouped_swiglu_experts`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Hashable, Sequence

import jax
import jax.numpy as jnp

__all__ = ["LayerPlan", "LayerStack", "PoolStack", "ExpertBank", "EXPERT_LEAVES", "run", "expert_weights",
           "layer_signature", "PartSpec"]

# Dict keys of per-layer parameters that hold routed experts ([E, in, out]); they stay whole in the scan
# (`ExpertBank`).
EXPERT_LEAVES = ("gate_up", "down")


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
class ExpertBank:
    """The routed experts of one layer as a view into a pattern position's stacked experts: `bank` [repeats, E,
    ...], `index` the layer's repeat (an int, or a traced int32 inside a scan). `expert_weights` turns it into the
    flat bank [repeats * E, ...] and the offset of this layer's first expert."""

    def __init__(self, bank, index):
        self.bank, self.index = bank, index

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.bank.shape[1:])

    @property
    def dtype(self):
        return self.bank.dtype

    def materialize(self):
        return jax.lax.dynamic_index_in_dim(self.bank, self.index, 0, keepdims=False)

    def tree_flatten(self):
        return (self.bank, self.index), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children)


def expert_weights(w) -> tuple[Any, Any]:
    """(weights [n * E, ...], offset of the layer's expert 0 in them) for an expert array [E, ...] (offset 0) or
    an `ExpertBank`."""
    if isinstance(w, ExpertBank):
        experts = w.bank.shape[1]
        return w.bank.reshape((-1,) + tuple(w.bank.shape[2:])), jnp.asarray(w.index, jnp.int32) * experts
    return w, 0


def _is_expert(path, stacked) -> bool:
    """A stacked part's leaf of routed experts: [repeats, E, in, out] under an EXPERT_LEAVES key (a dense MLP's
    "down" is [repeats, in, out])."""
    last = path[-1] if path else None
    return getattr(last, "key", None) in EXPERT_LEAVES and getattr(stacked, "ndim", 0) == 4


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
                parts.append(jax.tree.map(lambda *xs: _stack(list(xs), consume), *members))
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
            lambda path, a: ExpertBank(a, member) if _is_expert(path, a) else a[member], tree)

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
    sliced = jax.tree_util.tree_map_with_path(lambda p, a: None if _is_expert(p, a) else a, tree)
    banks = jax.tree_util.tree_map_with_path(lambda p, a: a if _is_expert(p, a) else None, tree)
    return sliced, banks


def _merge(sliced, banks, index):
    return jax.tree.map(lambda s, b: ExpertBank(b, index) if b is not None else s, sliced, banks,
                        is_leaf=lambda x: x is None)


def _flatten_members(tree):
    """Leaves [members, n, ...] -> [members * n, ...]."""
    return jax.tree.map(lambda a: a.reshape((-1,) + tuple(a.shape[2:])), tree)


def run(step: Step, carry, layers: LayerStack | Sequence, pools: PoolStack | Sequence) -> tuple[Any, tuple, list]:
    """Run every layer: `step(i, layer, params, pool, base, carry) -> (carry, (writes, decode))` where `i` is a
    representative layer index with the layer's structure (for its static choices: its type), `layer` the layer's
    own index (an int, or a traced int32 in the scan), `pool` its part's pool tree and `base` its base row there.
    `writes` is a `stitch.RowWrites` of rows already offset by `base`; `decode` any tree or None.

    pools: a `PoolStack`, or per layer its pool (every layer then runs unrolled, and `layers` must not be
    stacked). Returns (carry, per part the writes, flattened over the part's layers, per layer the decode tree)."""
    from hypic_jax.stitch import RowWrites

    if not isinstance(pools, PoolStack):  # per-layer pools: every layer unrolled
        pools = PoolStack(tuple(pools), (None,) * len(pools), LayerPlan.unrolled(len(pools)))
    plan = pools.plan
    if not isinstance(layers, LayerStack):
        layers = LayerStack.build(layers, plan)
    if layers.plan != plan:
        raise ValueError(f"parameters stacked by {layers.plan} but pools by {plan}")
    writes: list = [None] * plan.parts
    decode: list = [None] * plan.layers

    def unrolled(part: int, carry):
        i = plan.layer(part)
        carry, (w, d) = step(i, i, layers[i], pools.parts[part], 0, carry)
        writes[part], decode[i] = w, d
        return carry

    for part in range(plan.head):
        carry = unrolled(part, carry)
    if plan.period:
        body_parts = range(plan.head, plan.head + plan.period)
        split = [_split_experts(layers.parts[p]) for p in body_parts]

        def body(carry, xs):
            g, sliced = xs
            outs = []
            for j, part in enumerate(body_parts):
                params = _merge(sliced[j], split[j][1], g)
                base = g * pools.specs[part].lead
                carry, out = step(plan.layer(part), plan.head + g * plan.period + j, params, pools.parts[part],
                                  base, carry)
                outs.append(out)
            return carry, tuple(outs)

        members = jnp.arange(plan.repeats, dtype=jnp.int32)
        carry, ys = jax.lax.scan(body, carry, (members, tuple(s for s, _ in split)))
        for j, part in enumerate(body_parts):
            w, d = ys[j]
            writes[part] = RowWrites(w.rows.reshape(-1), _flatten_members(w.values))
            for g in range(plan.repeats):
                decode[plan.layer(part, g)] = None if d is None else jax.tree.map(lambda a: a[g], d)
    for part in range(plan.head + plan.period, plan.parts):
        carry = unrolled(part, carry)
    return carry, tuple(writes), decode


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

