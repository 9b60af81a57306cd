"""Training a small Qwen3.5-architecture hybrid (Gated DeltaNet + gated full attention) on the generated corpus.

The loss is the cross entropy of the answer tokens (and the `<|eos|>` after them) only. Every batch is a function
of (seed, step) alone, so a run resumed from a checkpoint sees the same data as one that never stopped. `train`
runs for at most `minutes` of wall time per call, then saves an orbax checkpoint (params, optimizer state, step) and
returns; calling it again continues from the latest checkpoint until `steps` are done.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import json
import math
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from hypic_jax.models import qwen3_5
from hypic_jax.models.base import KernelOptions, cache_positions
from hypic_jax.train import corpus
from hypic_jax.train import tokenizer as tok

# name -> (model shape, data shape). "h200": 6 GDN + 2 full-attention layers of hidden 256, 8.3M parameters
# (16.6 MB in bfloat16); "smoke": a few minutes on one CPU core; "micro": the tests' size.
# "large": 9 GDN + 3 gated attention layers of hidden 512, 56.9M parameters, for quality at long context: prompts of
# 16 to 128 documents (at the end of the curriculum) up to 32,768 tokens, the update family among the tasks. Most of
# its parameters are in the MLPs (intermediate 2,304), whose matrix products a GPU runs at a good share of its peak;
# 12 layers rather than more keep the sequential parts (each GDN layer's scan over its chunks, every layer unrolled
# in the step) short. One 32,768-token row per step at that length, more rows at shorter ones (`rows_for`).
# Data keys beside the model's: seq_len, batch, questions (per prompt), max_docs and min_docs (documents per prompt
# at the end of the curriculum: from min_docs, 2 unless given, to max_docs), max_filler (filler sentences per
# document, at most), families (the task families of training prompts; corpus.FAMILIES unless given).
SIZES = {
    "h200": dict(hidden_size=256, layers=8, intermediate_size=640, num_attention_heads=4, head_dim=64,
                 linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=32, linear_value_head_dim=64,
                 vocab_size=2048, seq_len=8192, batch=8, questions=32, max_docs=64, max_filler=6),
    "smoke": dict(hidden_size=64, layers=4, intermediate_size=192, num_attention_heads=4, head_dim=16,
                  linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                  vocab_size=1024, seq_len=512, batch=4, questions=8, max_docs=8, max_filler=2),
    "micro": dict(hidden_size=32, layers=2, intermediate_size=64, num_attention_heads=2, head_dim=16,
                  linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
                  vocab_size=512, seq_len=128, batch=2, questions=4, max_docs=3, max_filler=0),
    "large": dict(hidden_size=512, layers=12, intermediate_size=2304, num_attention_heads=8, head_dim=64,
                  linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
                  vocab_size=2048, seq_len=32768, batch=1, questions=64, min_docs=16, max_docs=128, max_filler=24,
                  families=corpus.ALL_FAMILIES),
}


@dataclasses.dataclass(frozen=True)
class Settings:
    """Everything a run depends on (saved beside its checkpoints; a resumed run reads it back)."""

    size: str = "smoke"
    seed: int = 0
    steps: int = 2000
    learning_rate: float = 3e-3
    warmup: int = 100
    weight_decay: float = 0.01
    compute_dtype: str = "float32"
    batch: int = 0  # 0: the size's default (likewise seq_len, questions, min_docs, max_docs, max_filler)
    seq_len: int = 0
    questions: int = 0
    min_docs: int = 0  # documents per prompt at the end of the curriculum: min_docs to max_docs
    max_docs: int = 0
    max_filler: int = 0  # filler sentences per document at the end of the curriculum: 0 to max_filler
    # task families of the training prompts, comma-separated (corpus.ALL_FAMILIES names them); "": the size's
    families: str = ""
    ramp: float = 0.7  # fraction of the steps over which the curriculum grows
    # rows are cut to the shortest of the lengths min_row_len, 2 min_row_len, ..., seq_len that holds the step's
    # prompts, with more rows when they are short (see row_lengths); 0: every row is seq_len long
    min_row_len: int = 1024
    # a Hugging Face folder (an earlier run's export) whose weights and tokenizer start this run: a second stage
    # continues a finished one with its own schedule, curriculum (ramp 0: the full curriculum throughout) and seed
    init_from: str = ""
    # a penalty on the GDN gates' per-token decay rate -g beyond decay_budget, weighted by decay_weight (0: off).
    # Trained on answer tokens alone, the linear layers learn to forget within a document (their states then carry
    # nothing across documents, and dropping T costs nothing); a budget keeps their memory longer than a document
    decay_budget: float = 0.0
    decay_weight: float = 0.0
    # added to every GDN layer's A_log of the starting weights: a shift of -log(r) divides every gate's decay rate
    # by r, so a trained model whose gates forget within a token (rates of 1 to 110 per token) starts a stage with
    # its decay under the budget instead of walking there one optimizer step at a time
    gate_shift: float = 0.0

    def shape(self) -> dict:
        shape = dict(SIZES[self.size])
        for name in ("batch", "seq_len", "questions", "min_docs", "max_docs", "max_filler"):
            if getattr(self, name):
                shape[name] = getattr(self, name)
        return shape

    def curriculum(self) -> corpus.Curriculum:
        shape = self.shape()
        return corpus.Curriculum(min_docs=(1, 2), max_docs=(shape.get("min_docs", 2), shape["max_docs"]),
                                 min_filler=0, max_filler=shape["max_filler"], ramp=self.ramp)

    def task_families(self) -> tuple[str, ...]:
        if self.families:
            families = tuple(f.strip() for f in self.families.split(",") if f.strip())
        else:
            families = tuple(SIZES[self.size].get("families", corpus.FAMILIES))
        unknown = set(families) - set(corpus.ALL_FAMILIES)
        if unknown or not families:
            raise ValueError(f"task families {self.families!r}: each one of {', '.join(corpus.ALL_FAMILIES)}")
        return families


# Training differentiates through the forward: the XLA chunk loops and `lax.ragged_dot`, which have gradients
# (the Pallas kernels define none).
TRAIN_KERNELS = KernelOptions(linear="xla", moe="ragged")


def model_config(size: str, vocab_size: int | None = None) -> qwen3_5.Config:
    """The size's Qwen3.5 hybrid: GDN layers with a gated full-attention layer every fourth (3:1) from 4 layers,
    one last full-attention layer below that; dense MLPs; 2 KV heads, a quarter of each head rotated."""
    s = SIZES[size]
    layers = s["layers"]
    return qwen3_5.Config(
        vocab_size=vocab_size or s["vocab_size"], hidden_size=s["hidden_size"],
        layer_types=qwen3_5.default_layer_types(layers) if layers >= 4 else
        (qwen3_5.LINEAR,) * (layers - 1) + (qwen3_5.FULL,),
        mlp_types=("dense",) * layers, num_attention_heads=s["num_attention_heads"], num_key_value_heads=2,
        head_dim=s["head_dim"], rotary_dim=s["head_dim"] // 4, rope_theta=10_000.0,
        linear_num_key_heads=s["linear_num_key_heads"], linear_num_value_heads=s["linear_num_value_heads"],
        linear_key_head_dim=s["linear_key_head_dim"], linear_value_head_dim=s["linear_value_head_dim"],
        intermediate_size=s["intermediate_size"],
    )


# ----------------------------------------------------------------------------------------------------------------
# Data


def training_prompt(seed: int, step: int, row: int, settings: Settings) -> corpus.Prompt:
    progress = step / max(settings.steps, 1)
    return corpus.sample_prompt(_mix(seed, step, row), settings.curriculum(), progress, settings.shape()["questions"],
                                settings.task_families())


def _mix(*values: int) -> int:
    """A 63-bit seed from integers (training seeds; bench/quality.py draws held-out seeds from another stream)."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = ((h ^ (v & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return h & 0x7FFFFFFFFFFFFFFF


def encode_fitting(tokenizer, prompt: corpus.Prompt, seq_len: int):
    """encode_prompt, dropping trailing documents until the prompt fits, with the questions whose evidence they hold
    and the count questions (whose answers would change); ValueError when no question is left."""
    while True:
        try:
            return tok.encode_prompt(tokenizer, prompt, max_tokens=seq_len + 1)
        except ValueError:
            if len(prompt.documents) <= 1:
                raise
            keep = len(prompt.documents) - max(1, len(prompt.documents) // 4)
            # (a count's evidence may be empty: no one lives in the city)
            questions = tuple(q for q in prompt.questions if q.family != "count" and max(q.evidence) < keep)
            if not questions:  # counts over the kept documents no longer hold: ask single questions instead
                raise
            prompt = corpus.Prompt(prompt.documents[:keep], questions)


def row_lengths(settings: Settings) -> tuple[int, ...]:
    """The row lengths a run's batches take: min_row_len doubled up to seq_len (seq_len alone when min_row_len is 0
    or not below seq_len). Early in the curriculum prompts are a few hundred tokens, so a fixed seq_len row would be
    mostly padding; each length is one compiled step."""
    seq_len = settings.shape()["seq_len"]
    if not settings.min_row_len or settings.min_row_len >= seq_len:
        return (seq_len,)
    lengths, length = [], settings.min_row_len
    while length < seq_len:
        lengths.append(length)
        length *= 2
    return (*lengths, seq_len)


def rows_for(settings: Settings, length: int) -> int:
    """Rows of a batch of `length`-token rows: the size's batch at seq_len, and as many rows as fill half the
    tokens of a seq_len batch at shorter lengths (so a short step still sees many questions)."""
    shape = settings.shape()
    return max(shape["batch"], shape["batch"] * shape["seq_len"] // (2 * length))


def _encoded_row(tokenizer, settings: Settings, step: int, row: int, length: int):
    attempt = 0
    while True:
        prompt = training_prompt(settings.seed, step, row * 1000 + attempt, settings)
        try:
            return encode_fitting(tokenizer, prompt, length)
        except ValueError:
            attempt += 1
            if attempt == 100:
                raise ValueError(f"no prompt of the curriculum fits {length} tokens") from None


def make_batch(tokenizer, settings: Settings, step: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(inputs, targets, weights), each [rows, length], of training step `step`.

    The first `batch` prompts are drawn for seq_len; the row length is the shortest of `row_lengths` that holds
    them, and the further rows of that length (`rows_for`) are fitted to it. All of it is a function of
    (seed, step)."""
    shape = settings.shape()
    pad = tokenizer.token_to_id(tok.PAD)
    encoded = [_encoded_row(tokenizer, settings, step, row, shape["seq_len"]) for row in range(shape["batch"])]
    longest = max(sum(map(len, docs)) + len(question[0]) for docs, question in encoded)
    length = next(n for n in row_lengths(settings) if n + 1 >= longest)
    encoded += [_encoded_row(tokenizer, settings, step, row, length)
                for row in range(shape["batch"], rows_for(settings, length))]
    rows = [tok.pack(docs, question, length, pad) for docs, question in encoded]
    return tuple(np.stack(column) for column in zip(*rows))


# ----------------------------------------------------------------------------------------------------------------
# Model and optimizer


_KEEP_FLOAT32 = ("A_log", "dt_bias")


def cast_params(params: dict, dtype) -> dict:
    """params in the compute dtype, the GDN decay parameters kept in float32 (as the model stores them)."""
    def cast(path, x):
        name = getattr(path[-1], "key", None)
        return x if name in _KEEP_FLOAT32 else x.astype(dtype)
    return jax.tree_util.tree_map_with_path(cast, params)


def forward_with_gates(params: dict, config: qwen3_5.Config, tokens, gate_stat, init):
    """(logits [B, L, vocab], stat): the model's forward (`qwen3_5.block` on every layer), folding each GDN layer's
    gate, its log decay per token g [B, L, Hv] (the layer's `mixing.CausalMixing.inputs`), into
    `stat = gate_stat(stat, g)` from `init` on the way. The stat rides beside the hidden states, so it may be any
    pytree whose structure the layers keep (under a scanned layer stack: fixed shapes)."""
    from hypic_jax.models import layers, mixing, stack as layer_stack

    positions = cache_positions(None, tokens.shape[1])

    def step(i, layer, lp, cache, pool, carry):
        x, stat = carry
        mix = mixing.CausalMixing(None, positions, None, kernels=TRAIN_KERNELS)
        x = qwen3_5.block(i, layer, lp, x, mix, config)
        if mix.inputs is not None:
            stat = gate_stat(stat, mix.inputs.g)
        return (x, stat), (None, None)

    (x, stat), _, _ = layer_stack.run(step, (params["embed"][tokens], init), params["layers"])
    x = layers.rms_norm(x, params["final_norm"], config.rms_norm_eps, offset=1.0)
    return qwen3_5.lm_head(params, config, x), stat


def forward_with_decay(params: dict, config: qwen3_5.Config, tokens, decay_budget: float = 0.0):
    """(logits, decay excess): the mean over GDN layers, tokens and value heads of max(0, -g - decay_budget), g the
    gate's log decay per token (0 for a model without GDN layers)."""
    linear = config.layer_types.count(qwen3_5.LINEAR)
    excess = lambda acc, g: acc + jnp.mean(jax.nn.relu(-g - decay_budget)) / linear  # noqa: E731
    return forward_with_gates(params, config, tokens, excess, jnp.zeros((), jnp.float32))


def answer_loss(params: dict, config: qwen3_5.Config, inputs, targets, weights, compute_dtype=jnp.float32,
                decay_budget: float = 0.0, with_decay: bool = False):
    """(mean cross entropy over the weighted (answer) tokens, the decay excess of `forward_with_decay`: 0 unless
    with_decay)."""
    cast = cast_params(params, compute_dtype)
    if with_decay:
        logits, excess = forward_with_decay(cast, config, inputs, decay_budget)
    else:
        (logits, _), excess = qwen3_5.forward(cast, config, inputs, kernels=TRAIN_KERNELS), jnp.zeros((), jnp.float32)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return jnp.sum(nll * weights) / jnp.maximum(jnp.sum(weights), 1.0), excess


def loss_fn(params: dict, config: qwen3_5.Config, inputs, targets, weights, compute_dtype=jnp.float32,
            decay_budget: float = 0.0, decay_weight: float = 0.0):
    """The training objective: the answer tokens' mean cross entropy, plus decay_weight times the decay excess
    (`forward_with_decay`) when decay_weight is set."""
    nll, excess = answer_loss(params, config, inputs, targets, weights, compute_dtype, decay_budget,
                              bool(decay_weight))
    return nll + decay_weight * excess


def optimizer(settings: Settings):
    import optax

    schedule = optax.warmup_cosine_decay_schedule(0.0, settings.learning_rate, min(settings.warmup, settings.steps),
                                                  max(settings.steps, settings.warmup + 1), settings.learning_rate / 10)
    decay_mask = lambda params: jax.tree.map(lambda x: x.ndim >= 2, params)  # noqa: E731  (no decay on norms, gates)
    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=settings.weight_decay, mask=decay_mask))


@functools.lru_cache(maxsize=8)
def make_step(config: qwen3_5.Config, settings: Settings):
    """The jitted training step (cached, like `compile_steps` that compiles it per row length)."""
    import optax

    opt, compute_dtype = optimizer(settings), jnp.dtype(settings.compute_dtype)

    def objective(params, inputs, targets, weights):
        nll, excess = answer_loss(params, config, inputs, targets, weights, compute_dtype, settings.decay_budget,
                                  bool(settings.decay_weight))
        return nll + settings.decay_weight * excess, (nll, excess)

    @jax.jit
    def step(params, opt_state, inputs, targets, weights):
        """-> (params, opt_state, (answer loss, decay excess)); the objective is their weighted sum."""
        (_, parts), grads = jax.value_and_grad(objective, has_aux=True)(params, inputs, targets, weights)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, parts

    return step


@functools.lru_cache(maxsize=8)
def compile_steps(config: qwen3_5.Config, settings: Settings) -> dict:
    """{(rows, length): the step compiled for that batch shape}, for every row length of the run, compiled in
    parallel (XLA compiles outside the GIL) so that no step of the loop waits for a compile; cached, so a run
    resumed in the same process compiles nothing."""
    step_fn, opt = make_step(config, settings), optimizer(settings)
    params = jax.eval_shape(lambda: qwen3_5.init_params(config, jax.random.key(0), jnp.float32))
    opt_state = jax.eval_shape(opt.init, params)
    shapes = [(rows_for(settings, n), n) for n in row_lengths(settings)]
    lowered = []
    for rows, length in shapes:
        tokens = jax.ShapeDtypeStruct((rows, length), jnp.int32)
        lowered.append(step_fn.lower(params, opt_state, tokens, tokens, jax.ShapeDtypeStruct((rows, length),
                                                                                             jnp.float32)))
    with concurrent.futures.ThreadPoolExecutor(len(lowered)) as pool:
        compiled = list(pool.map(lambda program: program.compile(), lowered))
    return dict(zip(shapes, compiled))


def init_state(settings: Settings, config: qwen3_5.Config, opt) -> dict:
    if settings.init_from:
        from hypic_jax.checkpoint import load

        start = load(settings.init_from, dtype="float32")
        params = start.params
        expected = jax.eval_shape(lambda: qwen3_5.init_params(config, jax.random.key(0)))
        if jax.tree.structure(params) != jax.tree.structure(expected):
            raise ValueError(f"{settings.init_from} does not hold a model of size {settings.size!r}")
    else:
        params = qwen3_5.init_params(config, jax.random.key(settings.seed), jnp.float32)
    if settings.gate_shift:
        params = shift_gates(params, settings.gate_shift)
    return dict(params=params, opt_state=opt.init(params), step=jnp.zeros((), jnp.int32))


def shift_gates(params: dict, shift: float) -> dict:
    """params with `shift` added to every A_log (each GDN gate's decay rate times exp(shift))."""
    def move(path, x):
        return x + shift if getattr(path[-1], "key", None) == "A_log" else x
    return jax.tree_util.tree_map_with_path(move, params)


# ----------------------------------------------------------------------------------------------------------------
# Runs: a folder with settings.json, tokenizer.json, checkpoints/ and log.jsonl


def _manager(run: Path):
    import orbax.checkpoint as ocp

    return ocp.CheckpointManager(run.absolute() / "checkpoints", options=ocp.CheckpointManagerOptions(max_to_keep=2))


def prepare_run(run: str | Path, settings: Settings) -> tuple[Settings, object]:
    """Create the run folder (settings, tokenizer) or read back an existing one's settings and tokenizer."""
    run = Path(run)
    if (run / "settings.json").exists():
        saved = Settings(**json.loads((run / "settings.json").read_text()))
        return saved, tok.load_tokenizer(run / "tokenizer.json")
    run.mkdir(parents=True, exist_ok=True)
    if settings.init_from:
        tokenizer = tok.load_tokenizer(settings.init_from)
    else:
        tokenizer = tok.train_tokenizer(SIZES[settings.size]["vocab_size"], seed=settings.seed,
                                        families=settings.task_families())
    tokenizer.save(str(run / "tokenizer.json"))
    (run / "settings.json").write_text(json.dumps(dataclasses.asdict(settings), indent=1))
    return settings, tokenizer


def restore(run: str | Path, settings: Settings, config: qwen3_5.Config, opt) -> dict:
    """The latest checkpoint of the run, or a fresh state."""
    import orbax.checkpoint as ocp

    with _manager(Path(run)) as manager:
        latest = manager.latest_step()
        fresh = init_state(settings, config, opt)
        if latest is None:
            return fresh
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, fresh)
        return manager.restore(latest, args=ocp.args.StandardRestore(abstract))


def save(run: str | Path, state: dict) -> None:
    import orbax.checkpoint as ocp

    with _manager(Path(run)) as manager:
        manager.save(int(state["step"]), args=ocp.args.StandardSave(state), force=True)
        manager.wait_until_finished()


def train(run: str | Path, settings: Settings = Settings(), minutes: float = 10.0, max_steps: int | None = None,
          progress: bool = True) -> dict:
    """Train for at most `minutes` (and at most `max_steps` more steps), checkpoint, return the state.

    The returned dict holds params, opt_state and step; log.jsonl in the run folder gets one line per 10 steps.
    """
    from tqdm import tqdm

    run = Path(run)
    settings, tokenizer = prepare_run(run, settings)
    config = model_config(settings.size, tokenizer.get_vocab_size())
    opt = optimizer(settings)
    state = restore(run, settings, config, opt)
    start_step = int(state["step"])
    end_step = settings.steps if max_steps is None else min(settings.steps, start_step + max_steps)
    deadline = time.monotonic() + 60 * minutes
    params, opt_state = state["params"], state["opt_state"]
    compile_started = time.monotonic()
    steps = compile_steps(config, settings)
    compile_s = time.monotonic() - compile_started
    step, losses, excesses, tokens, started = start_step, [], [], 0, time.monotonic()
    bar = tqdm(total=end_step, initial=start_step, disable=not progress, desc=f"train {settings.size}", unit="step")
    # the next batch is built on the host while the device runs this step (batches depend on the step alone)
    pad = tokenizer.token_to_id(tok.PAD)
    pool = concurrent.futures.ThreadPoolExecutor(1)
    upcoming = pool.submit(make_batch, tokenizer, settings, step)
    with open(run / "log.jsonl", "a") as log:
        while step < end_step and time.monotonic() < deadline:
            batch = upcoming.result()
            upcoming = pool.submit(make_batch, tokenizer, settings, step + 1)
            params, opt_state, (loss, excess) = steps[batch[0].shape](params, opt_state, *batch)
            step += 1
            tokens += int(np.count_nonzero(batch[0] != pad))
            losses.append(float(loss))
            excesses.append(float(excess))
            bar.update(1)
            if step % 10 == 0 or step == end_step:
                mean = float(np.mean(losses[-10:]))
                bar.set_postfix(loss=f"{mean:.3f}", rows=f"{batch[0].shape[0]}x{batch[0].shape[1]}")
                elapsed = time.monotonic() - started
                extra = dict(decay_excess=round(float(np.mean(excesses[-10:])), 5)) if settings.decay_weight else {}
                log.write(json.dumps(dict(step=step, loss=mean, **extra, time=time.time(), rows=batch[0].shape[0],
                                          length=batch[0].shape[1], tokens_per_s=round(tokens / elapsed),
                                          seconds_per_step=round(elapsed / (step - start_step), 4),
                                          compile_s=round(compile_s, 1))) + "\n")
                log.flush()
    bar.close()
    pool.shutdown(cancel_futures=True)
    state = dict(params=params, opt_state=opt_state, step=jnp.asarray(step, jnp.int32))
    if step > start_step:
        save(run, state)
    return state


def load_run(run: str | Path) -> tuple[qwen3_5.Config, dict, object, Settings]:
    """(config, params, tokenizer, settings) of a run's latest checkpoint."""
    if not (Path(run) / "settings.json").exists():
        raise ValueError(f"{run} is not a training run (no settings.json)")
    settings, tokenizer = prepare_run(run, Settings())
    config = model_config(settings.size, tokenizer.get_vocab_size())
    state = restore(run, settings, config, optimizer(settings))
    if int(state["step"]) == 0:
        raise ValueError(f"{run} has no checkpoint yet")
    return config, state["params"], tokenizer, settings


def parameter_count(params) -> int:
    return int(sum(math.prod(x.shape) for x in jax.tree.leaves(params)))


# ----------------------------------------------------------------------------------------------------------------
# Held-out evaluation

EVAL_STREAM = 0xE7A1  # held-out prompts mix four integers (this stream first); training prompts mix three


def heldout_prompt(seed: int, num_docs: int, index: int, questions: int = 8, filler: int = 2,
                   families: tuple[str, ...] = corpus.FAMILIES) -> corpus.Prompt:
    """Prompt `index` of `num_docs` documents of the held-out stream (bench/quality.py asks the same prompts)."""
    return corpus.make_prompt(_mix(EVAL_STREAM, seed, num_docs, index), num_docs, questions, filler, families)


def answer_accuracy(params: dict, config: qwen3_5.Config, tokenizer, docs: int = 16, prompts: int = 8,
                    questions: int = 8, filler: int = 2, seed: int = 0, rows: int = 16,
                    families: tuple[str, ...] = corpus.FAMILIES) -> dict:
    """Exact match per task family of held-out questions, each asked alone after its prompt's documents.

    Scored by teacher forcing: greedy decoding writes the answer and its `<|eos|>` exactly when every one of those
    tokens is the argmax after the gold prefix, so one forward per question gives the greedy exact match without a
    decode loop. Returns {family: {"em", "n"}} with an "all" entry."""
    cases = []  # (tokens, first answer position, family)
    for i in range(prompts):
        prompt = heldout_prompt(seed, docs, i, questions, filler, families)
        context = [t for d in prompt.documents for t in tok.encode(tokenizer, tok.document_text(d))]
        for q in prompt.questions:
            head = context + tok.encode(tokenizer, tok.question_text(q.text))
            cases.append((head + tok.encode(tokenizer, tok.answer_text(q.answer)), len(head), q.family))
    length = -(-max(len(t) for t, _, _ in cases) // 256) * 256
    pad = tokenizer.token_to_id(tok.PAD)
    predict = jax.jit(lambda p, t: jnp.argmax(qwen3_5.forward(p, config, t, kernels=TRAIN_KERNELS)[0], axis=-1))
    hits = []
    for lo in range(0, len(cases), rows):
        chunk = cases[lo:lo + rows]
        batch = np.full((rows, length), pad, np.int32)
        for r, (tokens, _, _) in enumerate(chunk):
            batch[r, :len(tokens)] = tokens
        predicted = np.asarray(predict(params, jnp.asarray(batch)))
        for r, (tokens, start, _) in enumerate(chunk):
            hits.append(bool((predicted[r, start - 1:len(tokens) - 1] == np.asarray(tokens[start:])).all()))
    out = {}
    for family in sorted({f for _, _, f in cases}) + ["all"]:
        picked = [h for h, (_, _, f) in zip(hits, cases) if family in (f, "all")]
        out[family] = dict(em=round(float(np.mean(picked)), 4), n=len(picked))
    return out
