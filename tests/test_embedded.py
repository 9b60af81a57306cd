"""The embedded model (`hypic_jax.checkpoint.embedded`): a micro model exported by `hypic_jax.train.export` stands in for the
trained one. With it installed, `load_served(None)` serves it with the question-answering chat template,
`Engine.from_pretrained()` without a path loads it and generates, `hypic-jax serve` builds on it and the demo asks
it held-out questions in every mode; without it, the random fallback and a clear error."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hypic_jax
from hypic_jax import demo
from hypic_jax.checkpoint import embedded
from hypic_jax.engine import MODES, Engine, EngineOptions, stack_layers
from hypic_jax.engine.requests import sampling_params
from hypic_jax.models import qwen3_5
from hypic_jax.models.base import Model
from hypic_jax.options import GIB
from hypic_jax.serve import model as served_model
from hypic_jax.serve.protocol import ChatRenderer
from hypic_jax.train import corpus, export, trainer
from hypic_jax.train import tokenizer as tok


# the module on one xdist worker (`--dist loadgroup`, pyproject.toml): the exported model built once
pytestmark = pytest.mark.xdist_group("embedded")

# small engines: a few MB of pools, one decode row, short prompts (the CPU's derived 1 GiB of pools and 8 rows of
# 4352 keys are not what these tests are about)
SMALL = EngineOptions().replace(cache_bytes=1 << 22, max_batch=1, max_prompt_tokens=256, max_new_tokens=16,
                                max_segments=4)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A micro model exported in bfloat16 (as the trained model is), in a folder named like the embedded one."""
    tokenizer = tok.train_tokenizer(512, seed=0, prompts=120)
    config = trainer.model_config("micro", tokenizer.get_vocab_size())
    params = qwen3_5.init_params(config, jax.random.key(0), jnp.float32)
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(1), len(leaves))  # off the init, so the answers depend on the weights
    params = jax.tree.unflatten(treedef, [x + 0.1 * jax.random.normal(k, x.shape, x.dtype)
                                          for k, x in zip(keys, leaves)])
    return export.export_folder(params, config, tokenizer, tmp_path_factory.mktemp("assets") / "hypic-qa")


@pytest.fixture
def installed(folder, monkeypatch):
    monkeypatch.setattr(embedded, "EMBEDDED_MODEL", folder)
    return folder


@pytest.fixture
def absent(tmp_path, monkeypatch):
    missing = tmp_path / "assets" / "hypic-qa"
    monkeypatch.setattr(embedded, "EMBEDDED_MODEL", missing)
    return missing


def _request(tokenizer, num_docs: int = 3):
    prompt = trainer.heldout_prompt(0, num_docs, 0, questions=2, filler=0)
    docs = [tok.encode(tokenizer, tok.document_text(d)) for d in prompt.documents]
    return prompt, docs, tok.encode(tokenizer, tok.question_text(prompt.questions[0].text))


def test_without_the_embedded_model(absent):
    assert embedded.embedded_model() is None
    with pytest.raises(FileNotFoundError, match=str(absent)):
        Engine.from_pretrained()
    served = served_model.load_served(None, options=SMALL)
    assert served.name == served_model.DEFAULT_NAME and served.engine.config.vocab_size == 512
    served.engine.close()


def test_default_model_serves_the_embedded_folder(installed):
    assert embedded.embedded_model() == installed
    served = served_model.load_served(None, dtype="float32", options=SMALL)
    engine = served.engine
    assert served.name == "hypic-qa" and engine.model.source.startswith(str(installed.resolve()))
    tokenizer = tok.load_tokenizer(installed)
    assert engine.tokenizer.get_vocab() == tokenizer.get_vocab()
    assert served.eos_ids == (tokenizer.token_to_id(tok.EOS),)
    assert engine.max_context == json.loads((installed / "config.json").read_text())["max_position_embeddings"]
    reference = trainer.cast_params(qwen3_5.init_params(engine.config, jax.random.key(0), jnp.float32),
                                    jnp.float32)
    # the engine holds the layers stacked (`stack_layers`): the reference's, stacked alike
    stacked = stack_layers(Model(qwen3_5, engine.config, reference)).params
    assert jax.tree.structure(engine.params) == jax.tree.structure(stacked)
    embed = np.asarray(engine.params["embed"])
    assert embed.dtype == np.float32 and not np.array_equal(embed, np.asarray(reference["embed"]))  # the folder's
    engine.close()


def test_chat_renders_the_training_layout(installed, tmp_path):
    """Documents (and system messages) become `<|doc|> text\\n` segments, the last user message the question; a
    folder exported without a chat template gets the same one from its special tokens."""
    prompt = corpus.make_prompt(3, 2, 1)
    messages = [dict(role="system", content="Answer from the documents."),
                *[dict(role="user", content=d) for d in prompt.documents],
                dict(role="user", content=prompt.questions[0].text)]
    expected = [tok.document_text(m["content"]) for m in messages[:-1]] + [tok.question_text(messages[-1]["content"])]
    served = served_model.load_served(None, dtype="float32", options=SMALL)
    served.engine.close()
    assert served.chat_template == tok.CHAT_TEMPLATE
    assert ChatRenderer(served.chat_template, served.special_tokens).render(messages) == expected

    bare = tmp_path / "bare"
    bare.mkdir()
    for f in installed.iterdir():
        (bare / f.name).write_bytes(f.read_bytes())
    config = json.loads((bare / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    bare_served = served_model.load_served(bare, dtype="float32", options=SMALL)
    bare_served.engine.close()
    assert bare_served.chat_template == tok.CHAT_TEMPLATE
    # an earlier answer in the conversation is laid out as in training (one segment: the split changes)
    history = messages[:-1] + [dict(role="user", content="q1"), dict(role="assistant", content="a1"),
                               dict(role="user", content="q2")]
    assert ChatRenderer(tok.CHAT_TEMPLATE).render(history) == ["".join(expected[:-1]) + tok.question_text("q1")
                                                               + tok.answer_text("a1") + tok.question_text("q2")]


def test_transformers_renders_the_same_chat(installed):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(installed))
    messages = [dict(role="user", content="About A. A lives in B."), dict(role="user", content="Where does A live?")]
    text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "".join(ChatRenderer(tok.CHAT_TEMPLATE).render(messages))
    assert text == tok.document_text(messages[0]["content"]) + tok.question_text(messages[1]["content"])


def test_engine_from_pretrained_without_a_path(installed):
    engine = Engine.from_pretrained(dtype="float32", options=SMALL, seam=2)
    assert engine.tokenizer is not None and engine.max_context == 32768
    prompt, docs, query = _request(engine.tokenizer)
    eos = engine.tokenizer.token_to_id(tok.EOS)
    gen = engine.generate(docs + [query], max_new_tokens=4, stop=[eos], mode="full_recompute")
    # the first token is the argmax of the folder's model over the whole prompt
    model = hypic_jax.load(installed, dtype="float32")
    forward = jax.jit(qwen3_5.forward, static_argnames="config")
    logits, _ = forward(model.params, model.config, jnp.asarray([sum(docs, []) + query], jnp.int32))
    assert gen.tokens[0] == int(jnp.argmax(logits[0, -1]))
    assert gen.text == engine.tokenizer.decode(gen.tokens)
    text = [tok.document_text(d) for d in prompt.documents] + [tok.question_text(prompt.questions[0].text)]
    assert engine.segment_tokens(text) == docs + [query]  # text segments go through the folder's tokenizer
    # a special token's text stops at its id (decoded text never shows it); other strings stay text matches
    params = sampling_params(max_new_tokens=4, temperature=1.0, top_p=1.0, top_k=0, seed=None,
                             stop=[tok.EOS, "\n", 7], logprobs=None, vocab_size=engine.vocab_size,
                             tokenizer=engine.tokenizer, top_logprobs=engine.top_logprobs)
    assert (params.stop_token_ids, params.stop) == ({eos, 7}, (tok.EOS, "\n"))
    engine.close()


def test_serve_builds_on_the_embedded_model(installed):
    from hypic_jax.serve.app import build

    server = build(None, dtype="float32", cache_bytes=int(0.02 * GIB), max_batch=1, max_prompt_tokens=256,
                   max_new_tokens=16, max_segments=4)
    assert server.model_name == "hypic-qa" and server.limits.eos_ids == (tok.SPECIAL_TOKENS.index(tok.EOS),)
    assert server.renderer.render([dict(role="user", content="d"), dict(role="user", content="q")]) == [
        tok.document_text("d"), tok.question_text("q")]
    assert server.engine.tiers.host is None and server.engine.tiers.disk is None  # tiers are opt-in
    server.close()


def test_serve_flags_reach_the_cache_tiers(installed, tmp_path, monkeypatch, capsys):
    """`hypic-jax serve --host-cache-gb --disk-cache-dir --disk-cache-gb --eviction --tier-dtype` build an engine
    with those tiers; a negative or non-finite budget is refused naming its flag (or, from Python, its field)."""
    from hypic_jax import cli
    from hypic_jax.serve import app

    built = []
    small = dict(cache_bytes=int(0.02 * GIB), max_batch=1, max_prompt_tokens=256, max_new_tokens=16, max_segments=4)
    monkeypatch.setattr(app, "main", lambda args: built.append(app.build(
        args.model, dtype="float32", options=args.engine_options.replace(**small))) or 0)
    assert cli.main(["serve", "--host-cache-gb", "0.01", "--disk-cache-dir", str(tmp_path / "disk"),
                     "--disk-cache-gb", "0.5", "--eviction", "lru", "--tier-dtype", "bfloat16"]) == 0
    engine = built[0].engine
    assert engine.tiers.host is not None and engine.tiers.disk is not None and engine.eviction == "lru"
    assert engine.tiers.disk.folder == tmp_path / "disk" and engine.mover.compact == "bfloat16"
    assert engine.tiers.disk.capacity_bytes == 1 << 29 and engine.tiers.host.capacity_bytes == int(0.01 * (1 << 30))
    built[0].close()
    capsys.readouterr()
    for bad in ("-1", "nan", "inf"):
        with pytest.raises(SystemExit) as refused:  # argparse: usage and the error, exit status 2
            cli.main(["serve", "--host-cache-gb", bad])
        assert refused.value.code == 2
        assert "argument --host-cache-gb: --host-cache-gb" in capsys.readouterr().err, bad
    assert len(built) == 1  # nothing was built for a refused flag
    for bad in (-1, float("nan"), 0.5):
        with pytest.raises(ValueError, match="host_cache_bytes must be a whole number >= 0"):
            app.build(None, host_cache_bytes=bad)
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="disk_cache_dir .*cannot create it"):
        app.build(None, dtype="float32", disk_cache_dir=str(tmp_path / "file" / "under"), **small)
    # no --max-batch: 64 decode rows on an accelerator, 8 on the CPU (these tests' backend)
    assert EngineOptions().resolve(max_context=None, backend="cpu").limits.max_batch == 8
    assert EngineOptions().resolve(max_context=None, backend="gpu").limits.max_batch == 64
    server = app.build(None, dtype="float32", **{**small, "max_batch": None})
    assert server.engine.max_batch == 8
    server.close()


def test_demo_questions_in_every_mode(installed, capsys):
    result = demo.qa_demo(installed, docs=3, questions=2, seam=2, max_new_tokens=4)
    tokens = result["document_tokens"]
    assert len(result["documents"]) == 3 and len(result["questions"]) == 2
    assert result["timed_compiles"] == 0
    first, second = result["questions"]
    assert sorted(first["order"]) == [0, 1, 2] and first["order"] != second["order"]
    rows = {(r["question"], r["mode"]): r for r in result["rows"]}
    assert len(rows) == 2 * len(MODES)
    for mode in MODES:
        assert rows[0, mode]["cached_tokens"] == 0  # each mode starts from an empty cache
    assert rows[1, "full_recompute"]["cached_tokens"] == 0
    for mode in ("addition", "transition", "transition_rope"):
        assert rows[1, mode]["cached_tokens"] == sum(tokens) and rows[1, mode]["cold_tokens"] == 0
    assert rows[1, "transition_rope_recompute"]["cached_tokens"] == sum(n - 2 for n in tokens)
    for q in range(2):  # no prefix hit on reordered documents: prefix caching computes what full recompute does
        assert rows[q, "prefix_cache"]["answer"] == rows[q, "full_recompute"]["answer"]
        for mode in MODES:
            assert rows[q, mode]["correct"] == (rows[q, mode]["answer"] == result["questions"][q]["answer"])
    demo.print_qa_demo(result)
    out = capsys.readouterr().out
    assert first["text"] in out and f"gold answer: {first['answer']}" in out
    assert out.count("transition_rope_recompute") >= 2


def test_demo_main_asks_the_embedded_model_when_installed(folder, tmp_path, monkeypatch, capsys):
    asked = []
    monkeypatch.setattr(demo, "qa_demo", lambda f, **kw: asked.append((f, kw)) or "result")
    monkeypatch.setattr(demo, "print_qa_demo", lambda result: print("questions:", result))
    monkeypatch.setattr(embedded, "EMBEDDED_MODEL", tmp_path / "missing")
    demo.main(["--no-engine"])
    assert asked == [] and capsys.readouterr().out == ""  # as before: no model, no question part
    monkeypatch.setattr(embedded, "EMBEDDED_MODEL", folder)
    demo.main(["--no-engine", "--docs", "5"])
    assert asked[0][0] == folder and asked[0][1]["docs"] == 5 and "questions: result" in capsys.readouterr().out
    demo.main(["--no-engine", "--no-questions"])
    assert len(asked) == 1
