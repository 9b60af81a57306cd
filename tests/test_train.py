"""The training pipeline: corpus generator, tokenizer, optimizer steps, resumable checkpoints, Hugging Face export."""

from __future__ import annotations

import collections
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hypic_jax
from hypic_jax.models import qwen3_5
from hypic_jax.train import corpus, export, trainer
from hypic_jax.train import tokenizer as tok
from helpers import rel_err


@pytest.fixture(scope="module")
def tokenizer():
    return tok.train_tokenizer(512, seed=0, prompts=120)


def _people(document: str) -> str:
    return re.match(r"About (.+?)\. ", document).group(1)


def test_generator_is_deterministic_and_seeds_differ():
    a, b = corpus.make_prompt(7, 6, 8, filler=2), corpus.make_prompt(7, 6, 8, filler=2)
    assert a == b
    assert corpus.make_prompt(8, 6, 8, filler=2) != a
    assert len(a.documents) == 6 and len(a.questions) == 8
    curriculum = corpus.Curriculum(min_docs=(1, 2), max_docs=(2, 64), max_filler=4, ramp=0.5)
    assert curriculum.at(0.0) == ((1, 2), 0) and curriculum.at(1.0) == ((2, 64), 4)
    sizes = [len(corpus.sample_prompt(s, curriculum, 1.0).documents) for s in range(40)]
    assert min(sizes) >= 2 and max(sizes) <= 64 and max(sizes) > 8


@pytest.mark.parametrize("num_docs", [2, 5, 16, 64])
def test_answers_are_in_the_named_documents(num_docs):
    families = set()
    for seed in range(6):
        prompt = corpus.make_prompt(seed, num_docs, 12, filler=1)
        docs = prompt.documents
        for q in prompt.questions:
            families.add(q.family)
            if q.family == "single":
                (d,) = q.evidence
                assert _people(docs[d]) in q.text and re.search(rf"\b{re.escape(q.answer)}\.", docs[d])
            elif q.family == "multihop":
                first, second = q.evidence
                colleague = _people(docs[second])
                assert _people(docs[first]) in q.text and f"works with {colleague}." in docs[first]
                assert re.search(rf"\b{re.escape(q.answer)}\.", docs[second])
            elif q.family == "count":
                city = re.match(r"How many people live in (\w+)\?", q.text).group(1)
                holders = [i for i, d in enumerate(docs) if re.search(rf"(lives in|home in) {city}\.", d)]
                assert int(q.answer) == len(holders) and q.evidence == tuple(holders)
            else:
                key = re.match(r"Which value does key (\w+) hold\?", q.text).group(1)
                (d,) = q.evidence
                assert f"Key {key} holds {q.answer}." in docs[d]
                assert sum(f"Key {key} " in doc for doc in docs) == 1
    assert families == set(corpus.FAMILIES) if num_docs >= 5 else families <= set(corpus.FAMILIES)


def test_default_families_generate_as_before():
    """Prompts without the update family are those the embedded model was trained and scored on: a digest of
    prompts of 1 to 64 documents, taken before the family existed."""
    import hashlib

    digest = hashlib.sha256()
    for seed in range(20):
        for n in (1, 3, 16, 64):
            p = corpus.make_prompt(seed, n, 12, filler=seed % 3)
            assert p == corpus.make_prompt(seed, n, 12, filler=seed % 3, families=corpus.FAMILIES)
            digest.update(repr((p.documents, [(q.family, q.text, q.answer, q.evidence) for q in p.questions])).encode())
    assert digest.hexdigest() == "55cfcf23fb59a12882684166ba4be5728bc38cd18ea13d2ecb3d0c339fafc738"


def _city_statements(docs: list[str]) -> dict[str, list[tuple[int, str]]]:
    """person -> [(document, city)] of every sentence saying where the person lives, in document order."""
    out = {}
    for d, doc in enumerate(docs):
        for name, city in re.findall(r"([A-Z]\w+ [A-Z]\w+) (?:lives in|has a home in|moved to|has since moved to) "
                                     r"([A-Z]\w+)\.", doc):
            out.setdefault(name, []).append((d, city))
    return out


@pytest.mark.parametrize("num_docs", [2, 5, 16, 64])
def test_update_family_answers_the_later_value(num_docs):
    """An update question asks, in a single or needle question's words, a fact that a later document changed: the
    answer is the later value, the evidence is (the fact's document, the changing one), the earlier value is the
    distractor and the only other value stated for it. The other families answer with the prompt's state after
    every change."""
    seen = collections.Counter()
    for seed in range(8):
        prompt = corpus.make_prompt(seed, num_docs, 24, filler=1, families=corpus.ALL_FAMILIES)
        docs = prompt.documents
        cities = _city_statements(list(docs))
        now = {name: said[-1][1] for name, said in cities.items()}
        for q in prompt.questions:
            seen[q.family] += 1
            if q.family == "update":
                first, later = q.evidence
                assert first < later and q.answer != q.distractor and q.distractor
                key = re.match(r"Which value does key (\w+) hold\?", q.text)
                if key:
                    key = key.group(1)
                    assert f"Key {key} holds {q.distractor}." in docs[first]
                    assert re.search(rf"The value of key {key} (was changed to|is now) {q.answer}\.", docs[later])
                    assert sum(key in doc for doc in docs) == 2
                    assert re.fullmatch(r"\d{3}", q.answer) and re.fullmatch(r"\d{3}", q.distractor)
                else:
                    name = next(n for n in cities if n in q.text)
                    assert cities[name] == [(first, q.distractor), (later, q.answer)]
                    assert _people(docs[first]) == name
                    single_words = {w.format(name=name) for w in corpus._FACTS["city"][1]}
                    assert q.text in single_words
                    assert q.distractor in {c for said in cities.values() for _, c in said}  # a city of the prompt
            elif q.family == "single" and ("live" in q.text or "home of" in q.text):
                name = next(n for n in cities if n in q.text)
                assert len(cities[name]) == 1 and q.answer == now[name]
            elif q.family == "count":
                city = re.match(r"How many people live in (\w+)\?", q.text).group(1)
                assert int(q.answer) == sum(c == city for c in now.values())
                involved = {d for said in cities.values() if city in {c for _, c in said} for d, _ in said}
                assert set(q.evidence) == involved
            elif q.family == "needle":
                key = re.match(r"Which value does key (\w+) hold\?", q.text).group(1)
                assert sum(key in doc for doc in docs) == 1 and f"Key {key} holds {q.answer}." in docs[q.evidence[0]]
    if num_docs >= 5:
        assert set(seen) == set(corpus.ALL_FAMILIES), seen
    assert seen["update"] > 0


def test_trimming_keeps_prompts_whose_counts_are_zero(tokenizer):
    """encode_fitting drops trailing documents of a prompt too long for its row, with the counts, also when a count's
    evidence is empty (no one lives in the city)."""
    prompt = next(p for p in (corpus.make_prompt(s, 12, 16, filler=2) for s in range(100))
                  if any(q.family == "count" and not q.evidence for q in p.questions))
    docs, (tokens, _) = trainer.encode_fitting(tokenizer, prompt, 400)
    assert sum(map(len, docs)) + len(tokens) <= 401 and len(docs) < len(prompt.documents)


def test_tokenizer_round_trip_and_layout(tokenizer):
    prompt = corpus.make_prompt(3, 4, 3, filler=1)
    for text in map(tok.document_text, prompt.documents):
        assert tokenizer.decode(tok.encode(tokenizer, text), skip_special_tokens=False) == text
    ids = tok.special_ids(tokenizer)
    assert sorted(ids.values()) == list(range(len(tok.SPECIAL_TOKENS)))
    assert tok.encode(tokenizer, tok.ANSWER) == [ids[tok.ANSWER]]
    docs, (tokens, mask) = tok.encode_prompt(tokenizer, prompt)
    answers = [t for t, m in zip(tokens, mask) if m]
    expected = [t for q in prompt.questions for t in tok.encode(tokenizer, tok.answer_text(q.answer))]
    assert answers == expected and answers.count(ids[tok.EOS]) == 3
    inputs, targets, weights = tok.pack(docs, (tokens, mask), 512, ids[tok.PAD])
    assert (targets[weights > 0] == np.asarray(expected)).all()
    assert (inputs[1:] == targets[:-1]).all()


def _micro(**overrides) -> trainer.Settings:
    return trainer.Settings(size="micro", seed=0, steps=4, learning_rate=1e-2, warmup=1, **overrides)


def test_optimizer_steps_reduce_the_loss_on_a_fixed_batch(tokenizer):
    settings = _micro()
    config = trainer.model_config("micro", tokenizer.get_vocab_size())
    batch = trainer.make_batch(tokenizer, settings, 0)
    assert batch[2].sum() > 0
    state = trainer.init_state(settings, config, trainer.optimizer(settings))
    step = trainer.make_step(config, settings)
    loss = jax.jit(trainer.loss_fn, static_argnums=1)  # one program (op by op, the forward compiles every op)
    before = float(loss(state["params"], config, *batch))
    params, opt_state = state["params"], state["opt_state"]
    for _ in range(3):
        params, opt_state, _ = step(params, opt_state, *batch)
    after = float(loss(params, config, *batch))
    assert after < before - 0.1, (before, after)


def test_resumed_training_equals_uninterrupted(tmp_path):
    straight = trainer.train(tmp_path / "a", _micro(), progress=False)
    assert int(straight["step"]) == 4
    first = trainer.train(tmp_path / "b", _micro(), max_steps=2, progress=False)
    assert int(first["step"]) == 2
    resumed = trainer.train(tmp_path / "b", _micro(), progress=False)
    assert int(resumed["step"]) == 4
    for x, y in zip(jax.tree.leaves(straight), jax.tree.leaves(resumed)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert (tmp_path / "b" / "tokenizer.json").exists()
    fresh = trainer.init_state(_micro(), trainer.model_config("micro", 512), trainer.optimizer(_micro()))
    assert not np.array_equal(np.asarray(fresh["params"]["embed"]), np.asarray(resumed["params"]["embed"]))


def test_decay_penalty_reads_the_gates_and_training_lowers_it(tokenizer):
    config = trainer.model_config("micro", tokenizer.get_vocab_size())
    assert config.layer_types[0] == qwen3_5.LINEAR and config.layer_types.count(qwen3_5.LINEAR) == 1
    params = _perturbed_params(config)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (2, 24)), jnp.int32)
    # one program for every call below (run eagerly, each call would compile every op anew)
    forward_with_decay = jax.jit(trainer.forward_with_decay, static_argnums=1)
    logits, excess = forward_with_decay(params, config, tokens, 0.0)
    want = jax.jit(qwen3_5.forward, static_argnums=1)(params, config, tokens)[0]
    np.testing.assert_allclose(logits, want, rtol=1e-5, atol=1e-5)
    # the first layer's gates from its input (the embeddings), in float64
    p = jax.tree.map(lambda x: np.asarray(x, np.float64), params["layers"][0])
    x = np.asarray(params["embed"], np.float64)[np.asarray(tokens)]
    h = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + config.rms_norm_eps) * (1.0 + p["input_norm"])
    rate = np.exp(p["mixer"]["A_log"]) * np.logaddexp(0.0, h @ p["mixer"]["in_proj_a"] + p["mixer"]["dt_bias"])
    budget = float(np.median(rate))
    for b in (0.0, budget, float(rate.max()) + 1.0):
        got = float(forward_with_decay(params, config, tokens, b)[1])
        np.testing.assert_allclose(got, np.maximum(rate - b, 0).mean(), rtol=1e-4, atol=1e-7)
    assert float(excess) > 0
    # a weighted penalty lowers the decay rate the training steps leave
    settings = _micro(decay_budget=0.0, decay_weight=10.0)
    batch = trainer.make_batch(tokenizer, settings, 0)
    step = trainer.make_step(config, settings)
    state = trainer.init_state(settings, config, trainer.optimizer(settings))
    params, opt_state = state["params"], state["opt_state"]
    before = float(forward_with_decay(params, config, jnp.asarray(batch[0]), 0.0)[1])
    for _ in range(3):
        params, opt_state, _ = step(params, opt_state, *batch)
    after = float(forward_with_decay(params, config, jnp.asarray(batch[0]), 0.0)[1])
    assert after < 0.8 * before, (before, after)
    # a gate shift divides every rate by exp(-shift): the excess over a zero budget scales with it
    shifted = trainer.init_state(_micro(gate_shift=-2.0), config, trainer.optimizer(settings))["params"]
    moved = float(forward_with_decay(shifted, config, jnp.asarray(batch[0]), 0.0)[1])
    np.testing.assert_allclose(moved, before * np.exp(-2.0), rtol=1e-4)


def _perturbed_params(config, seed=0):
    """Random params with every leaf moved off its init, so zero-initialised norms and gates matter."""
    params = qwen3_5.init_params(config, jax.random.key(seed), jnp.float32)
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    return jax.tree.unflatten(treedef, [x + 0.1 * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)])


def test_export_round_trip_and_transformers_parity(tmp_path, tokenizer):
    import torch
    import transformers as tf

    config = trainer.model_config("micro", tokenizer.get_vocab_size())
    params = _perturbed_params(config)
    folder = export.export_folder(params, config, tokenizer, tmp_path / "f32", "float32")
    loaded = hypic_jax.load(folder, dtype="float32")
    assert loaded.config == config  # the kernel choices are no part of a config (`trainer.TRAIN_KERNELS`)
    assert jax.tree.structure(loaded.params) == jax.tree.structure(params)
    for x, y in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(params)):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))

    tokens = np.asarray([tok.encode(tokenizer, tok.document_text(corpus.make_prompt(1, 1, 1).documents[0]))[:40]],
                        np.int32)
    ours, _ = jax.jit(qwen3_5.forward, static_argnames="config")(params, config, tokens)
    reference = tf.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    assert type(reference).__name__ == "Qwen3_5ForCausalLM"
    with torch.no_grad():
        theirs = reference(input_ids=torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    assert rel_err(ours, theirs, norm="max") < 1e-4

    half = export.export_folder(params, config, tokenizer, tmp_path / "bf16")
    assert (half / "model.safetensors").stat().st_size < export.MAX_BYTES
    loaded = hypic_jax.load(half, dtype="bfloat16")
    for x, y in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(trainer.cast_params(params, jnp.bfloat16))):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert tok.load_tokenizer(half).get_vocab() == tokenizer.get_vocab()


def test_large_size_and_its_curriculum():
    """The long-context size: at least 50M parameters (from shapes alone) in the 3 GDN : 1 gated attention layout;
    its curriculum ends at 16 to 128 documents and 0 to 24 filler sentences, with the update family, in rows of
    2,048 to 32,768 tokens."""
    config = trainer.model_config("large")
    shapes = jax.eval_shape(lambda: qwen3_5.init_params(config, jax.random.key(0), jnp.bfloat16))
    count = trainer.parameter_count(shapes)
    assert count >= 50_000_000, count
    assert config.layer_types == (qwen3_5.LINEAR,) * 3 + (qwen3_5.FULL,) + (qwen3_5.LINEAR,) * 3 + (qwen3_5.FULL,) \
        + (qwen3_5.LINEAR,) * 3 + (qwen3_5.FULL,)
    settings = trainer.Settings(size="large", min_row_len=2048)
    assert settings.curriculum().at(1.0) == ((16, 128), 24) and settings.curriculum().at(0.0) == ((1, 2), 0)
    assert settings.task_families() == corpus.ALL_FAMILIES
    assert trainer.row_lengths(settings) == (2048, 4096, 8192, 16384, 32768)
    assert [trainer.rows_for(settings, n) for n in trainer.row_lengths(settings)] == [8, 4, 2, 1, 1]
    assert dataclasses.replace(settings, families="single,update").task_families() == ("single", "update")
    assert trainer.Settings(size="h200").task_families() == corpus.FAMILIES
    with pytest.raises(ValueError, match="task families"):
        dataclasses.replace(settings, families="single,typo").task_families()


def test_train_command_resumes_where_it_stopped(tmp_path, capsys):
    """`python -m hypic_jax.train train` with --max-steps stops and checkpoints; the same command continues the step
    count from the checkpoint (the run's saved settings win over the flags) up to --steps."""
    from hypic_jax.train.__main__ import main

    run = tmp_path / "run"
    command = ["train", "--run", str(run), "--size", "micro", "--steps", "5", "--warmup", "1", "--max-steps", "3",
               "--families", "single,update", "--no-progress"]
    main(command)
    assert "step 3 of 5" in capsys.readouterr().out
    main(command[:-1] + ["--steps", "9", "--no-progress"])  # a changed flag of a started run is not read
    out = capsys.readouterr().out
    assert "step 5 of 5" in out and "last log line" in out
    settings, _ = trainer.prepare_run(run, trainer.Settings())
    assert settings.steps == 5 and settings.task_families() == ("single", "update")
    assert trainer.restore(run, settings, trainer.model_config("micro", 512), trainer.optimizer(settings))["step"] == 5


def test_embedded_size_fits_the_budget():
    """The GPU size's weights in bfloat16 stay under the 20 MB budget of a model shipped in the package."""
    config = trainer.model_config("h200")
    shapes = jax.eval_shape(lambda: qwen3_5.init_params(config, jax.random.key(0), jnp.bfloat16))
    nbytes = sum(np.prod(s.shape) * s.dtype.itemsize for s in jax.tree.leaves(shapes))
    assert 5e6 < nbytes < export.MAX_BYTES


def test_quality_bench_at_ci_size(tmp_path, tokenizer):
    """bench/quality.py on a micro exported model: every question is scored in each mode, prefix caching
    generates exactly what full recompute does, and the floor row is computed from the gold answers."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("quality", Path(__file__).parents[1] / "bench" / "quality.py")
    quality = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(quality)
    config = trainer.model_config("micro", tokenizer.get_vocab_size())
    folder = export.export_folder(_perturbed_params(config, seed=3), config, tokenizer, tmp_path / "m", "float32")
    args = quality.argparse.Namespace(model=str(folder), dtype="float32", seed=0, docs=[2], prompts=1, questions=3,
                                      filler=0, modes=["full_recompute", "prefix_cache"], seams=[], seam=8,
                                      transformers=False, max_tokens=512, max_new_tokens=16, quantize=None)
    report = quality.run(args)
    assert report["cases"] == 3 and report["skipped_over_budget"] == 0
    assert report["agreement_with_full_recompute"] == {"full_recompute": 1.0, "prefix_cache": 1.0}
    for label in ("full_recompute", "prefix_cache", "most_frequent_answer"):
        assert report["scores"][label]["all=all"]["n"] == 3
    prompt = next(quality.heldout_prompts(0, [2], 1, 3, 0))[1]
    answers = [q.answer for q in prompt.questions]
    floor = report["scores"]["most_frequent_answer"]
    for family in {q.family for q in prompt.questions}:
        golds = [q.answer for q in prompt.questions if q.family == family]
        best = max(golds.count(a) for a in golds) / len(golds)
        assert floor[f"family={family}"]["em"] == pytest.approx(best, abs=1e-4)
    assert len(report["samples"]) == 3 and [s["answer"] for s in report["samples"]] == answers
    assert quality.token_f1([1, 2, 3], [2, 3, 4]) == pytest.approx(2 / 3) and quality.token_f1([5], [6]) == 0.0


def test_quality_bench_breakdowns_with_the_update_family(tmp_path, tokenizer, capsys):
    """bench/quality.py with --families naming update: held-out prompts with changes, scores crossed per family,
    position and number of documents, and the share of update answers that are the earlier value."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("quality", Path(__file__).parents[1] / "bench" / "quality.py")
    quality = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(quality)
    config = trainer.model_config("micro", tokenizer.get_vocab_size())
    folder = export.export_folder(_perturbed_params(config, seed=4), config, tokenizer, tmp_path / "m", "float32")
    args = quality.argparse.Namespace(model=str(folder), dtype="float32", seed=0, docs=[4], prompts=1, questions=5,
                                      filler=0, modes=["full_recompute"], seams=[], seam=8, transformers=False,
                                      max_tokens=512, max_new_tokens=16, quantize=None,
                                      families=list(corpus.ALL_FAMILIES))
    report = quality.run(args)
    prompt = next(quality.heldout_prompts(0, [4], 1, 5, 0, corpus.ALL_FAMILIES))[1]
    updates = [q for q in prompt.questions if q.family == "update"]
    assert report["cases"] == 5 and updates and report["families"] == list(corpus.ALL_FAMILIES)
    row = report["scores"]["full_recompute"]
    assert row["stale=update"]["n"] == len(updates) == row["family=update"]["n"]
    positioned = [q for q in prompt.questions if q.family != "count"]
    assert sum(v["n"] for k, v in row.items() if k.startswith("position@docs=")) == len(positioned)
    assert sum(v["n"] for k, v in row.items() if k.startswith("family@position=")) == len(positioned)
    for q in updates:
        assert f"update@{quality.position_bucket(q, 4)}" in {k.split("=", 1)[1] for k in row}
    quality.print_tables(report)
    out = capsys.readouterr().out
    assert "per quarter of the prompt holding the answer and number of documents" in out
    assert "update: share of answers that are the earlier, replaced value" in out


def test_rows_take_the_shortest_length_that_holds_the_step(tokenizer):
    """Bucketed rows: each step's rows have the shortest of the run's lengths that holds its first `batch`
    prompts, more rows at shorter lengths, every row fits, and a step's batch depends on (seed, step) alone."""
    settings = trainer.Settings(size="micro", seq_len=512, batch=2, min_row_len=128, steps=100, ramp=0.5)
    assert trainer.row_lengths(settings) == (128, 256, 512)
    assert [trainer.rows_for(settings, n) for n in (128, 256, 512)] == [4, 2, 2]
    assert trainer.row_lengths(dataclasses.replace(settings, min_row_len=0)) == (512,)
    assert trainer.row_lengths(dataclasses.replace(settings, min_row_len=512)) == (512,)
    pad = tokenizer.token_to_id(tok.PAD)
    seen = set()
    for step in (0, 40, 99):
        inputs, targets, weights = trainer.make_batch(tokenizer, settings, step)
        rows, length = inputs.shape
        seen.add(length)
        assert length in trainer.row_lengths(settings) and rows == trainer.rows_for(settings, length)
        assert weights.sum() > 0 and (weights.sum(axis=1) > 0).all()
        used = (np.concatenate([inputs[:, :1], targets], axis=1) != pad).sum(axis=1)
        # the first `batch` rows would not all have fitted the next shorter length (+1: the last target)
        shorter = [n for n in trainer.row_lengths(settings) if n < length]
        assert not shorter or used[:settings.shape()["batch"]].max() > shorter[-1] + 1
        again = trainer.make_batch(tokenizer, settings, step)
        for x, y in zip((inputs, targets, weights), again):
            np.testing.assert_array_equal(x, y)
    assert len(seen) > 1, seen


def test_second_stage_starts_from_an_exported_folder(tmp_path, tokenizer):
    """init_from: a run starts from an export's weights (bfloat16 widened to float32) and tokenizer; a folder of
    another size is refused."""
    config = trainer.model_config("micro", tokenizer.get_vocab_size())
    params = _perturbed_params(config, seed=5)
    folder = export.export_folder(params, config, tokenizer, tmp_path / "stage1")
    settings = dataclasses.replace(_micro(), init_from=str(folder), seed=3)
    saved, loaded_tokenizer = trainer.prepare_run(tmp_path / "stage2", settings)
    assert loaded_tokenizer.get_vocab() == tokenizer.get_vocab() and saved.init_from == str(folder)
    state = trainer.init_state(settings, config, trainer.optimizer(settings))
    for x, y in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(trainer.cast_params(params, jnp.bfloat16))):
        assert x.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y, np.float32))
    smoke = trainer.Settings(size="smoke", init_from=str(folder))
    with pytest.raises(ValueError, match="size 'smoke'"):
        trainer.init_state(smoke, trainer.model_config("smoke", tokenizer.get_vocab_size()), trainer.optimizer(smoke))


def test_teacher_forced_accuracy_equals_greedy_generation():
    """answer_accuracy scores a question right exactly when greedy decoding writes its answer and <|eos|>: checked
    per family against the model's own greedy generation, on the embedded trained model (which gets some right)."""
    from hypic_jax.train import EMBEDDED_MODEL

    model = hypic_jax.load(EMBEDDED_MODEL, dtype="float32")
    tokenizer = tok.load_tokenizer(EMBEDDED_MODEL)
    scores = trainer.answer_accuracy(model.params, model.config, tokenizer, docs=3, prompts=1, questions=6, rows=4)
    assert scores["all"]["n"] == 6 and sum(v["n"] for k, v in scores.items() if k != "all") == 6
    prompt = trainer.heldout_prompt(0, 3, 0, 6, 2)
    context = [t for d in prompt.documents for t in tok.encode(tokenizer, tok.document_text(d))]
    encode = lambda text: tok.encode(tokenizer, text)  # noqa: E731
    cases = [(context + encode(tok.question_text(q.text)), encode(tok.answer_text(q.answer)), q.family)
             for q in prompt.questions]
    # greedy decoding of as many tokens as the longest answer (a shorter answer is right when it is the prefix:
    # greedy tokens do not depend on how many follow), the questions of one prompt length as one batch: one
    # compilation per prompt length instead of one per (prompt length, answer length)
    new_tokens = max(len(answer) for _, answer, _ in cases)
    generated = {}
    for length in sorted({len(tokens) for tokens, _, _ in cases}):
        rows = [i for i, (tokens, _, _) in enumerate(cases) if len(tokens) == length]
        batch = np.asarray([cases[i][0] for i in rows], np.int32)
        out = np.asarray(model.generate(jnp.asarray(batch), new_tokens))
        generated.update({i: out[r].tolist() for r, i in enumerate(rows)})
    hits = {}
    for i, (_, answer, family) in enumerate(cases):
        hits.setdefault(family, []).append(generated[i][:len(answer)] == answer)
    for family, row in hits.items():
        assert scores[family]["em"] == pytest.approx(np.mean(row), abs=1e-4), (family, row, scores)
    assert 0 < scores["all"]["em"], scores
