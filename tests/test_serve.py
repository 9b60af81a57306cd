"""The OpenAI-compatible server (`hypic_jax.serve`) on a tiny Qwen3.5 checkpoint, over a real socket.

One engine and one server for the module (CPU compilation dominates): one token rung, 4 decode rows, a small
BPE tokenizer trained in memory. Checked: the `openai` client against it (completions and chat, streaming and not,
cached tokens of reordered documents, stop strings, seeded sampling), every bad input as a 4xx error in OpenAI's
shape naming its field, 64 concurrent clients answered once each with the greedy outputs of the same requests run
one at a time (and of `Engine.generate`), a full queue, a client leaving mid-stream, /metrics against what
was sent, and no compilation after warmup.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import threading
import time

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from hypic_jax.engine import Engine, backend_compiles  # noqa: E402
from hypic_jax.engine.scheduler import TextStream  # noqa: E402
from hypic_jax.serve import ApiError, Server  # noqa: E402
from hypic_jax.serve.protocol import ChatRenderer  # noqa: E402
from helpers import schedule_all, tiny_checkpoint  # noqa: E402

# the module on one xdist worker (`--dist loadgroup`, pyproject.toml): one server and its warmed-up engine
pytestmark = pytest.mark.xdist_group("serve")

MODEL = "tiny"
MAX_NEW = 16
SEAM = 4
WORDS = ("the quick brown fox jumps over a lazy dog while seven tired cats watch from an old wall near the river "
         "bank and every night the moon rises slowly above quiet hills").split()


def _tokenizer(vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    alphabet = list("abcdefghijklmnopqrstuvwxyz,.?:\n\u2581")  # \u2581: the Metaspace word marker
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>"], initial_alphabet=alphabet,
                                  limit_alphabet=len(alphabet), show_progress=False)
    rng = np.random.default_rng(0)
    tok.train_from_iterator([" ".join(rng.choice(WORDS, 12)) for _ in range(300)], trainer)
    assert tok.get_vocab_size() <= vocab
    return tok


def _text(rng, words: int) -> str:
    return " ".join(rng.choice(WORDS, words))


@pytest.fixture(scope="module")
def served(tiny_checkpoints):
    model, vocab, _ = tiny_checkpoints("qwen_dense")
    tokenizer = _tokenizer(vocab)
    engine = Engine(model, tokenizer=tokenizer, max_prompt_tokens=128, token_rungs=(128,), max_segments=8,
                    max_new_tokens=MAX_NEW, max_batch=4, cache_bytes=1 << 24, seam=SEAM, max_queue=128)
    server = Server(engine, model_name=MODEL, warm_on_start=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    http = uvicorn.Server(uvicorn.Config(server.app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=http.run, daemon=True)
    thread.start()
    while not http.started:
        time.sleep(0.02)
    base = f"http://127.0.0.1:{port}"
    cold = httpx.get(f"{base}/health")
    assert cold.status_code == 503
    assert httpx.post(f"{base}/v1/completions", json=dict(prompt=[1, 2])).status_code == 503
    server.warmup()
    assert httpx.get(f"{base}/health").status_code == 200
    assert engine.programs.wait(timeout=600)  # the programs compiling in the background, before counting
    yield dict(server=server, engine=engine, base=base, vocab=vocab, tokenizer=tokenizer,
               client=openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0),
               compiles=backend_compiles())
    http.should_exit = True
    thread.join(30)


def _post(served, path, body, **kw):
    return httpx.post(served["base"] + path, json=body, timeout=60, **kw)


def _metrics(served) -> dict:
    text = httpx.get(served["base"] + "/metrics").text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def _docs(served, seed: int, n: int = 3):
    rng = np.random.default_rng(seed)
    return [_text(rng, 10) for _ in range(n)], _text(rng, 4) + " ?"


# The openai client ----------------------------------------------------------------------------------------------
def test_completions_and_chat_with_the_openai_client(served):
    client = served["client"]
    assert [m.id for m in client.models.list().data] == [MODEL]
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model" and card == client.models.list().data[0]
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("gpt-4")
    assert missing.value.body["code"] == "model_not_found" and missing.value.body["param"] == "model"
    assert httpx.get(served["base"] + "/v1/models/org/name").json()["error"]["code"] == "model_not_found"
    docs, query = _docs(served, 1)
    prompt = "<<PIC_SEP>>".join(docs + [query])
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    assert first.choices[0].finish_reason == "length" and first.usage.completion_tokens == 8
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert first.usage.pic["misses"] == 3 and first.usage.pic["cold_tokens"] > 0
    lengths = [len(served["tokenizer"].encode(d, add_special_tokens=False).ids) for d in docs]
    reordered = "<<PIC_SEP>>".join([docs[2], docs[0], docs[1], query])
    second = client.completions.create(model=MODEL, prompt=reordered, max_tokens=8, temperature=0,
                                       extra_body=dict(return_token_ids=True))
    assert second.usage.prompt_tokens_details.cached_tokens == sum(n - SEAM for n in lengths)
    assert second.usage.pic["hits"] == 3 and second.usage.pic["cold_tokens"] == 0
    # the text is the detokenized ids, and the ids are what the engine generates alone
    ids = second.choices[0].model_extra["token_ids"]
    assert second.choices[0].text == served["tokenizer"].decode(ids)
    segs = served["engine"].segment_tokens(reordered)
    assert ids == served["engine"].generate(segs, max_new_tokens=8).tokens

    stream = client.completions.create(model=MODEL, prompt=reordered, max_tokens=8, temperature=0, stream=True,
                                       stream_options=dict(include_usage=True))
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == second.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == second.usage.prompt_tokens_details.cached_tokens

    messages = [dict(role="system", content="answer briefly"), dict(role="user", content=query)]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                          extra_body=dict(documents=docs[:2]))
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 6
    assert chat.usage.pic["segments"] == 4  # system, two documents, the query
    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                           extra_body=dict(documents=docs[:2][::-1]))
    assert again.usage.prompt_tokens_details.cached_tokens > 0 and again.usage.pic["hits"] >= 2
    streamed = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                              stream=True, extra_body=dict(documents=docs[:2][::-1]),
                                              logprobs=True, top_logprobs=3)
    parts = list(streamed)
    assert parts[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in parts) == again.choices[0].message.content
    assert parts[-1].choices[0].finish_reason == "length"
    tops = [t for p in parts if p.choices[0].logprobs for t in p.choices[0].logprobs.content]
    assert len(tops) == 6 and all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in tops)
    # greedy: the sampled token is the most likely one, and the alternatives are ranked
    assert all(abs(t.top_logprobs[0].logprob - t.logprob) < 1e-5 and t.top_logprobs[0].token == t.token
               and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob >= t.top_logprobs[2].logprob > -1e30
               for t in tops)


def test_stop_strings_and_ids(served):
    client = served["client"]
    prompt = _text(np.random.default_rng(5), 12)
    free = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_NEW, temperature=0,
                                     extra_body=dict(return_token_ids=True))
    text, ids = free.choices[0].text, free.choices[0].model_extra["token_ids"]
    assert len(text) >= 6, text
    stop = text[3:5]
    cut = text[:text.find(stop)]
    stopped = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_NEW, temperature=0, stop=[stop])
    assert (stopped.choices[0].text, stopped.choices[0].finish_reason) == (cut, "stop")
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_NEW, temperature=0,
                                            stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == cut and chunks[-1].choices[0].finish_reason == "stop"
    by_id = _post(served, "/v1/completions", dict(prompt=prompt, max_tokens=MAX_NEW, temperature=0,
                                                  stop_token_ids=[ids[2]], return_token_ids=True)).json()
    first = ids.index(ids[2])
    assert by_id["choices"][0]["token_ids"] == ids[:first + 1] and by_id["choices"][0]["finish_reason"] == "stop"


def test_seeded_sampling_is_reproducible_in_any_batch(served):
    client = served["client"]
    prompt = _text(np.random.default_rng(9), 8)

    def ask(seed, **kw):
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=1.5, top_p=0.95,
                                         seed=seed, extra_body=dict(return_token_ids=True, **kw))

    alone = ask(3).choices[0].model_extra["token_ids"]
    assert ask(3).choices[0].model_extra["token_ids"] == alone
    others = [ask(s).choices[0].model_extra["token_ids"] for s in (4, 5, 6)]
    assert any(o != alone for o in others)  # the seed matters

    async def together():
        aclient = openai.AsyncOpenAI(base_url=served["base"] + "/v1", api_key="none", max_retries=0)
        outs = await asyncio.gather(*[aclient.completions.create(
            model=MODEL, prompt=prompt, max_tokens=12, temperature=1.5, top_p=0.95, seed=s,
            extra_body=dict(return_token_ids=True)) for s in (4, 3, 5, 6)])
        await aclient.close()
        return [o.choices[0].model_extra["token_ids"] for o in outs]

    assert asyncio.run(together()) == [others[0], alone, others[1], others[2]]
    # one sampler: the same request and seed give the same tokens through the Python API
    engine = served["engine"]
    assert engine.generate(engine.segment_tokens(prompt), max_new_tokens=12, temperature=1.5, top_p=0.95,
                           seed=3).tokens == alone
    # top_k=1 is greedy whatever the temperature
    greedy = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                       extra_body=dict(return_token_ids=True)).choices[0].model_extra["token_ids"]
    assert ask(11, top_k=1).choices[0].model_extra["token_ids"] == greedy


# Bad input ------------------------------------------------------------------------------------------------------
BAD = [
    ("/v1/completions", b"{not json", None, 400),
    ("/v1/completions", b"[1, 2]", None, 400),
    ("/v1/completions", dict(max_tokens=2), "prompt", 400),
    ("/v1/completions", dict(prompt=5), "prompt", 400),
    ("/v1/completions", dict(prompt="a b", max_tokens="3"), "max_tokens", 400),
    ("/v1/completions", dict(prompt="a b", max_tokens=True), "max_tokens", 400),
    ("/v1/completions", dict(prompt="a b", model="gpt-4"), "model", 404),
    ("/v1/completions", dict(prompt=""), "prompt", 400),
    ("/v1/completions", dict(prompt=[]), "prompt", 400),
    ("/v1/completions", dict(prompt="a b<<PIC_SEP>><<PIC_SEP>>c"), "prompt", 400),
    ("/v1/chat/completions", dict(messages=[]), "messages", 400),
    ("/v1/chat/completions", dict(model=MODEL), "messages", 400),
    ("/v1/chat/completions", dict(messages=[dict(role="wizard", content="x")]), "messages[0].role", 400),
    ("/v1/chat/completions", dict(messages=[dict(role="user", content=3)]), "messages[0].content", 400),
    ("/v1/completions", dict(prompt=[5] * 129), "prompt", 400),
    ("/v1/completions", dict(prompt="a b", max_tokens=-1), "max_tokens", 400),
    ("/v1/completions", dict(prompt="a b", max_tokens=MAX_NEW + 1), "max_tokens", 400),
    ("/v1/completions", dict(prompt=[5] * 120, max_tokens=MAX_NEW + 8), "max_tokens", 400),
    ("/v1/completions", dict(prompt="a b", temperature=-0.1), "temperature", 400),
    ("/v1/completions", dict(prompt="a b", top_p=0), "top_p", 400),
    ("/v1/completions", dict(prompt="a b", top_p=1.5), "top_p", 400),
    ("/v1/completions", dict(prompt="a b", pic_mode="magic"), "pic_mode", 400),
    ("/v1/completions", dict(prompt="a b", seam=-1), "seam", 400),
    ("/v1/completions", dict(prompt="a b", seam=2.5), "seam", 400),
    ("/v1/completions", dict(prompt="a b", seam="wide"), "seam", 400),
    ("/v1/completions", dict(segments=[[3, 4], [5, 6], [7]], seam=[8]), "seam", 400),  # one knob per document
    ("/v1/completions", dict(segments=[[3, 4], [5, 6], [7]], seam=[8, "x"]), "seam", 400),
    ("/v1/completions", dict(segments=[[3, 4], [5, 6], [7]], seam=[8, 0.5, 1]), "seam", 400),
    ("/v1/completions", dict(prompt=[3, 1000]), "prompt", 400),
    ("/v1/completions", dict(prompt=[3, -1]), "prompt", 400),
    ("/v1/completions", dict(segments=[[3, 4], [9999]]), "segments[1]", 400),
    ("/v1/completions", dict(prompt="a b", n=2), "n", 400),
    ("/v1/completions", dict(prompt="a b", logprobs=99), "logprobs", 400),
    ("/v1/completions", dict(prompt="a b", stop=[3]), "stop", 400),
    ("/v1/completions", b'{"prompt": "a b", "max_tokens": ' + b"9" * 5000 + b"}", None, 400),  # past int digits
    ("/v1/completions", b"[" * 100000 + b"]" * 100000, None, 400),  # nested past the recursion limit
    ("/v1/completions", b'{"prompt": "a \\ud800 b"}', "prompt", 400),  # a lone surrogate
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udfff"}]}', "messages", 400),
    ("/v1/completions", b'{"prompt": "a b", "cache_salt": "\\ud800"}', "cache_salt", 400),
    ("/v1/completions", dict(prompt=[3, "a b"]), "prompt", 400),
    ("/v1/completions", dict(prompt=["a", "b"]), "prompt", 400),
    ("/v1/chat/completions", dict(messages=[dict(role="user", content="x")], response_format=dict(type="json_object")),
     "response_format", 400),
    ("/v1/completions", dict(prompt="a b", response_format=dict(type="json_schema", json_schema={})),
     "response_format", 400),
    ("/v1/chat/completions", dict(messages=[dict(role="user", content="x")],
                                  tools=[dict(type="function", function=dict(name="f"))]), "tools", 400),
    ("/v1/chat/completions", dict(messages=[dict(role="user", content="x")], tool_choice="required"), "tool_choice",
     400),
    ("/v1/chat/completions", dict(messages=[dict(role="user", content="x")], functions=[dict(name="f")]), "functions",
     400),
    ("/v1/completions", dict(prompt="a b", documents=["the fox"]), "documents", 400),
    ("/v1/completions", dict(prompt="a b", stream_options=dict(include_usage=True)), "stream_options", 400),
]


@pytest.mark.parametrize("path,body,param,status", BAD, ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD)])
def test_bad_input_is_a_4xx_naming_the_field(served, path, body, param, status):
    if isinstance(body, bytes):
        response = httpx.post(served["base"] + path, content=body, headers={"content-type": "application/json"})
    else:
        response = _post(served, path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    ok = _post(served, "/v1/completions", dict(prompt="the fox", max_tokens=2, temperature=0))
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_a_seam_per_document_over_http(served):
    """`seam` as an array of one knob per document: served, and echoed in `usage.pic`; every knob 1.0 recomputes
    every document (nothing read from the cache), so its greedy tokens are full recompute's."""
    segments = [[3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13], [14, 15]]
    body = dict(segments=segments, max_tokens=3, temperature=0, return_token_ids=True)
    full = _post(served, "/v1/completions", dict(body, pic_mode="full_recompute")).json()
    whole = _post(served, "/v1/completions", dict(body, pic_mode="transition_rope_recompute", seam=[1.0, 1.0])).json()
    assert whole["usage"]["pic"]["seam"] == [1.0, 1.0] and whole["usage"]["pic"]["cached_tokens"] == 0
    assert whole["choices"][0]["token_ids"] == full["choices"][0]["token_ids"]
    mixed = _post(served, "/v1/completions", dict(body, pic_mode="transition_rope_recompute", seam=[2, 0])).json()
    assert mixed["usage"]["pic"]["seam"] == [2.0, 0.0] and mixed["usage"]["completion_tokens"] == 3


def test_a_prompt_list_mixing_integers_and_other_values_says_what_a_prompt_is(served):
    """A list of integers and something else is a malformed prompt, not several prompts."""
    for prompt, where in (([3, 4, "the fox"], "prompt[2] is str"), ([3, None], "prompt[1] is NoneType"),
                          ([3, [4, 5]], "prompt[1] is list")):
        error = _post(served, "/v1/completions", dict(prompt=prompt)).json()["error"]
        assert "one string or a list of integers (token ids)" in error["message"] and where in error["message"]
        assert "several prompts" not in error["message"] and error["code"] == "invalid_type"
    error = _post(served, "/v1/completions", dict(prompt=["the fox", "a dog"])).json()["error"]
    assert "several prompts" in error["message"] and error["code"] == "unsupported"


def test_constrained_output_is_refused_not_ignored(served):
    """JSON mode, a JSON schema, tools or a forced tool choice would be answered as free text the client takes for
    what it asked: a 400 `unsupported` naming the field; the plain forms ("text", no tools, "none"/"auto") are
    served."""
    messages = [dict(role="user", content="the fox")]
    for field, value in (("response_format", dict(type="json_object")), ("tools", [dict(type="function")]),
                         ("tool_choice", dict(type="function", function=dict(name="f")))):
        error = _post(served, "/v1/chat/completions", {"messages": messages, field: value}).json()["error"]
        assert error["param"] == field and error["code"] == "unsupported", error
    plain = dict(messages=messages, max_tokens=2, response_format=dict(type="text"), tools=[], tool_choice="none")
    assert _post(served, "/v1/chat/completions", plain).json()["usage"]["completion_tokens"] == 2
    error = _post(served, "/v1/completions", dict(prompt="the fox", documents=["a dog"])).json()["error"]
    assert error["param"] == "documents" and "segments" in error["message"]


def test_a_stream_that_fails_before_its_first_token_is_answered_with_its_status(served, monkeypatch):
    """A streamed request that ends in an error before its first token (its deadline passed in the queue, a prefill
    the cache cannot hold) gets that error's HTTP status in OpenAI's shape, as without `stream`, not a 200 stream
    holding the error."""
    from hypic_jax.cache.pools import PoolFull

    for path, body in (("/v1/completions", dict(prompt="the fox")),
                       ("/v1/chat/completions", dict(messages=[dict(role="user", content="the fox")]))):
        response = _post(served, path, dict(body, max_tokens=4, stream=True, timeout=1e-9))
        assert response.status_code == 504, response.text
        assert response.json()["error"]["code"] == "deadline_exceeded"

    def full(tokens, evict):
        raise PoolFull(f"no room in the cache for an entry of {tokens} tokens")

    monkeypatch.setattr(served["engine"].pools, "allocate", full)
    segments = [[41, 42, 43, 44, 45, 46, 47], [48, 49, 50, 51, 52, 53], [54, 55]]  # not cached yet
    response = _post(served, "/v1/completions", dict(segments=segments, max_tokens=2, stream=True))
    assert response.status_code == 400 and "no room in the cache" in response.json()["error"]["message"]
    monkeypatch.undo()
    chunks = list(served["client"].completions.create(model=MODEL, prompt="the fox", max_tokens=3, stream=True))
    assert chunks[-1].choices[0].finish_reason == "length"


def test_logprob_tokens_add_up_to_the_text_streamed_or_not(served):
    """Each token of a logprobs block is the text it adds to the completion (decoded alone, a Metaspace token
    drops its leading space), so the tokens add up to the text and `text_offset` is where each starts, the same
    streamed or not; the alternatives are read in the same context."""
    body = dict(prompt="the quick brown", max_tokens=MAX_NEW, temperature=0, logprobs=2)
    choice = _post(served, "/v1/completions", body).json()["choices"][0]
    text, lp = choice["text"], choice["logprobs"]
    assert " " in text and choice["finish_reason"] == "length"
    assert "".join(lp["tokens"]) == text
    assert lp["text_offset"] == [len("".join(lp["tokens"][:i])) for i in range(len(lp["tokens"]))]
    assert all(next(iter(top)) == token for top, token in zip(lp["top_logprobs"], lp["tokens"]))  # greedy
    tokens, offsets = [], []
    for c in served["client"].completions.create(model=MODEL, stream=True, **body):
        if c.choices[0].logprobs:
            tokens += c.choices[0].logprobs.tokens
            offsets += c.choices[0].logprobs.text_offset
    assert (tokens, offsets) == (lp["tokens"], lp["text_offset"])
    chat = _post(served, "/v1/chat/completions", dict(messages=[dict(role="user", content="the quick brown")],
                                                       max_tokens=MAX_NEW, temperature=0, logprobs=True,
                                                       top_logprobs=1)).json()["choices"][0]
    content = chat["logprobs"]["content"]
    assert "".join(t["token"] for t in content) == chat["message"]["content"]
    assert all(t["top_logprobs"][0]["token"] == t["token"] and bytes(t["bytes"]).decode() == t["token"]
               for t in content)


def _content_length(response: bytes) -> int:
    head = response.split(b"\r\n\r\n", 1)[0].decode().lower()
    return next((int(line.split(":", 1)[1]) for line in head.split("\r\n") if line.startswith("content-length:")),
                0)


def test_a_body_over_the_limit_is_a_413_before_it_is_read(served, monkeypatch):
    """A body past `max_request_bytes` is a 413 in OpenAI's shape naming the limit: by its Content-Length before
    any of it arrives, and by the bytes read for a chunked body (no Content-Length); one within it is served."""
    server = served["server"]
    assert server.max_request_bytes == 256 * 128 + (1 << 20)  # the default for 128 prompt tokens
    monkeypatch.setattr(server, "max_request_bytes", 4096)
    port = int(served["base"].rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:  # headers only: no body will follow
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000000000\r\n\r\n")
        raw = b""
        while b"\r\n\r\n" not in raw or len(raw.split(b"\r\n\r\n", 1)[1]) < _content_length(raw):
            raw += s.recv(65536) or pytest.fail(f"the connection closed mid-response: {raw!r}")
    head, answer = raw.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 413"), raw
    error = json.loads(answer)["error"]
    assert error["code"] == "request_too_large" and "1000000000 bytes" in error["message"]
    assert "4096 bytes" in error["message"]
    body = dict(prompt=[4, 5], max_tokens=1, padding="x" * 3000)
    sized = _post(served, "/v1/completions", dict(body, padding="x" * 5000))
    chunked = httpx.post(served["base"] + "/v1/completions", content=iter([json.dumps(body).encode()] * 2),
                         headers={"content-type": "application/json"}, timeout=60)
    for response in (sized, chunked):
        assert response.status_code == 413, response.text
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == "request_too_large"
        assert "4096 bytes" in error["message"] and "--max-request-bytes" in error["message"]
    assert "transfer-encoding" in chunked.request.headers and "content-length" not in chunked.request.headers
    ok = httpx.post(served["base"] + "/v1/completions", content=iter([json.dumps(body).encode()]),
                    headers={"content-type": "application/json"}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 1


def test_health_answers_while_a_large_request_is_tokenized(served, monkeypatch):
    """Parsing and tokenizing run off the event loop: while one request's tokenization is held (the tokenizer
    blocks on an event), /health and /v1/models answer, and the held request is then served."""
    entered, release = threading.Event(), threading.Event()

    class Held:
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def encode(self, text, **kwargs):
            if "zebra" in text:
                entered.set()
                release.wait(30)
            return self.inner.encode(text, **kwargs)

    monkeypatch.setattr(served["server"], "tokenizer", Held(served["tokenizer"]))
    body = dict(prompt="the fox zebra", max_tokens=2, temperature=0, padding="x" * 500_000)  # under the limit
    answer = {}
    thread = threading.Thread(target=lambda: answer.update(response=_post(served, "/v1/completions", body)))
    thread.start()
    try:
        assert entered.wait(30)
        health = httpx.get(served["base"] + "/health", timeout=5)
        assert health.status_code == 200 and health.json()["status"] == "ok"
        assert httpx.get(served["base"] + "/v1/models", timeout=5).status_code == 200
        assert not answer
    finally:
        release.set()
        thread.join(60)
    assert answer["response"].status_code == 200 and answer["response"].json()["usage"]["completion_tokens"] == 2


def test_unknown_route_and_no_tokenizer(served, monkeypatch):
    response = httpx.get(served["base"] + "/v1/nothing")
    assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"
    wrong = httpx.get(served["base"] + "/v1/completions")
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
    monkeypatch.setattr(served["server"], "tokenizer", None)
    text = _post(served, "/v1/completions", dict(prompt="the fox"))
    assert text.status_code == 400 and text.json()["error"]["code"] == "no_tokenizer"
    assert text.json()["error"]["param"] == "prompt"
    chat = _post(served, "/v1/chat/completions", dict(messages=[dict(role="user", content="hi")]))
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages"
    ids = [7, 8, 9, 10, 11]
    body = _post(served, "/v1/completions", dict(segments=[ids, [12, 13]], max_tokens=5, temperature=0)).json()
    choice = body["choices"][0]
    assert choice["text"] == "" and len(choice["token_ids"]) == 5
    assert choice["token_ids"] == served["engine"].generate([ids, [12, 13]], max_new_tokens=5).tokens


# Load, queue, disconnects ---------------------------------------------------------------------------------------
def _mixed(i: int, served) -> tuple[str, dict]:
    rng = np.random.default_rng(100 + i)
    docs, query = _docs(served, 200 + i % 7)  # documents shared between requests, in other orders
    order = rng.permutation(len(docs))
    mode = ["transition_rope_recompute", "prefix_cache", "full_recompute", "transition_rope"][i % 4]
    common = dict(max_tokens=int(rng.integers(1, MAX_NEW + 1)), temperature=0, pic_mode=mode,
                  stream=bool(i % 3 == 0), return_token_ids=True)
    if i % 5 == 4:
        return "/v1/chat/completions", dict(common, messages=[dict(role="user", content=query)],
                                            documents=[docs[j] for j in order])
    if i % 5 == 3:
        vocab = served["vocab"]
        return "/v1/completions", dict(common, segments=[rng.integers(3, vocab, 9).tolist(), [5, 6, 7]])
    return "/v1/completions", dict(common, prompt="<<PIC_SEP>>".join([docs[j] for j in order] + [query]))


async def _ask(client: httpx.AsyncClient, path: str, body: dict):
    """(token ids, finish reason) of one request, streamed or not."""
    if not body["stream"]:
        response = await client.post(path, json=body)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        return choice["token_ids"], choice["finish_reason"]
    ids, reason = [], None
    async with client.stream("POST", path, json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            ids += choice.get("token_ids", [])
            reason = choice["finish_reason"] or reason
    return ids, reason


def test_a_request_the_cache_cannot_hold_is_a_400(served, monkeypatch):
    """A PIC request whose entries do not fit the pools (simulated: every allocation refused) is answered 400 in
    OpenAI's shape with the engine's message, not 500, and the server serves the next request."""
    from hypic_jax.cache.pools import PoolFull

    def full(tokens, evict):
        raise PoolFull(f"no room in the cache for an entry of {tokens} tokens")

    monkeypatch.setattr(served["engine"].pools, "allocate", full)
    segments = [[21, 22, 23, 24, 25, 26, 27], [28, 29, 30, 31, 32, 33], [34, 35]]  # documents not cached yet
    response = _post(served, "/v1/completions", dict(segments=segments, max_tokens=2, temperature=0))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and "no room in the cache" in error["message"]
    monkeypatch.undo()
    ok = _post(served, "/v1/completions", dict(segments=segments, max_tokens=2, temperature=0))
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_a_top_k_beyond_the_vocabulary_keeps_every_token(served):
    """top_k past the vocabulary, even past int32, keeps every token as top_k = vocabulary size does, instead of
    failing the request's admission and leaving its client waiting."""
    body = dict(prompt=[4, 5, 6], max_tokens=4, temperature=1.0, seed=5, return_token_ids=True)
    want = _post(served, "/v1/completions", dict(body, top_k=served["vocab"])).json()["choices"][0]["token_ids"]
    for k in (served["vocab"] + 1, 1 << 40):
        got = httpx.post(served["base"] + "/v1/completions", json=dict(body, top_k=k), timeout=20)
        assert got.status_code == 200 and got.json()["choices"][0]["token_ids"] == want


def test_a_failed_admission_is_answered_and_the_server_goes_on(served, monkeypatch):
    """A request whose insertion into a decode row fails is answered with a 500, not left outside every row with
    no answer, and the next request is served."""
    def broken(*args, **kwargs):
        raise RuntimeError("the device refused the row")

    monkeypatch.setattr(served["engine"], "slot_insert", broken)
    body = dict(prompt=[4, 5, 6], max_tokens=3, temperature=0)
    response = httpx.post(served["base"] + "/v1/completions", json=body, timeout=20)
    assert response.status_code == 500 and "the device refused the row" in response.json()["error"]["message"]
    monkeypatch.undo()
    ok = _post(served, "/v1/completions", body)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
    assert served["server"].scheduler.running == 0


def test_a_client_gone_before_its_body_is_no_server_error(served, caplog):
    """A client that closes its connection halfway through sending its body is not logged as a server error."""
    with socket.create_connection(("127.0.0.1", int(served["base"].rsplit(":", 1)[1]))) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"prompt\": ")
    time.sleep(1)
    assert _post(served, "/v1/completions", dict(prompt=[4, 5], max_tokens=1)).status_code == 200
    assert not [r for r in caplog.records if r.name == "hypic_jax.serve" and r.levelname == "ERROR"]


def test_64_concurrent_clients_match_one_at_a_time(served):
    requests = [_mixed(i, served) for i in range(64)]
    scheduler = served["server"].scheduler
    before = dict(scheduler.bucket_steps)

    async def run(parallel: bool):
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(base_url=served["base"], timeout=120, limits=limits) as client:
            if parallel:
                return await asyncio.gather(*[_ask(client, p, b) for p, b in requests])
            return [await _ask(client, p, b) for p, b in requests]

    together = asyncio.run(run(True))
    assert len(together) == 64
    assert scheduler.bucket_steps[4] > before.get(4, 0)  # decode steps ran 3-4 requests as one batch
    alone = asyncio.run(run(False))
    for (path, body), got, want in zip(requests, together, alone):
        assert got == want, (path, body)
        assert len(got[0]) == body["max_tokens"] and got[1] == "length"
    assert scheduler.running == 0 and scheduler.waiting == 0


def test_full_queue_is_429_and_loses_no_accepted_request(served):
    server, engine = served["server"], served["engine"]
    scheduler = server.scheduler
    old = scheduler.max_queue
    scheduler.max_queue = 2
    engine._device_lock.acquire()  # the scheduler blocks in its next prefill: arrivals queue up behind it
    try:
        async def burst():
            async with httpx.AsyncClient(base_url=served["base"], timeout=120) as client:
                post = lambda i: asyncio.create_task(client.post("/v1/completions", json=dict(  # noqa: E731
                    prompt=[3 + i, 4, 5], max_tokens=3, temperature=0)))
                tasks = [post(0)]
                start = time.monotonic()
                while scheduler.waiting or time.monotonic() - start < 0.3:  # taken: blocked in its prefill
                    await asyncio.sleep(0.02)
                tasks += [post(i) for i in range(1, 6)]  # two fit in the queue, three do not
                while sum(t.done() for t in tasks) < 3:
                    await asyncio.sleep(0.02)
                rejected = [t.result() for t in tasks if t.done()]
                assert scheduler.waiting == 2
                engine._device_lock.release()
                return rejected, await asyncio.gather(*tasks)

        rejected, answers = asyncio.run(burst())
    finally:
        scheduler.max_queue = old
        if engine._device_lock._is_owned():
            engine._device_lock.release()
    assert all(r.status_code == 429 and r.headers["retry-after"] for r in rejected)
    assert rejected[0].json()["error"]["code"] == "queue_full"
    codes = sorted(a.status_code for a in answers)
    assert codes == [200, 200, 200, 429, 429, 429]
    assert all(a.json()["usage"]["completion_tokens"] == 3 for a in answers if a.status_code == 200)


def test_client_leaving_mid_stream_is_cancelled_and_frees_its_row(served, monkeypatch):
    engine, scheduler = served["engine"], served["server"].scheduler
    gate = threading.Event()
    real = engine.slot_decode

    def gated(*args, **kwargs):  # the real step, held until the test lets it run
        gate.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(engine, "slot_decode", gated)
    cancelled = _metrics(served).get(("hypic:request_success_total", (("finished_reason", "cancelled"),)), 0)
    with httpx.Client(base_url=served["base"], timeout=30) as client:
        with client.stream("POST", "/v1/completions", json=dict(prompt=[4, 5, 6], max_tokens=MAX_NEW, temperature=0,
                                                               stream=True, return_token_ids=True)) as response:
            first = next(line for line in response.iter_lines() if line.startswith("data: "))
            assert len(json.loads(first[6:])["choices"][0]["token_ids"]) == 1
            assert scheduler.running == 1
    deadline = time.monotonic() + 10
    while not any(r is not None and r.cancelled for r in scheduler.rows) and time.monotonic() < deadline:
        time.sleep(0.02)
    held = [r for r in scheduler.rows if r is not None]
    assert held and held[0].cancelled
    gate.set()
    while scheduler.running and time.monotonic() < deadline:
        time.sleep(0.02)
    assert scheduler.running == 0 and len(held[0].tokens) < MAX_NEW
    after = _metrics(served)[("hypic:request_success_total", (("finished_reason", "cancelled"),))]
    assert after == cancelled + 1


# Metrics and compilation ----------------------------------------------------------------------------------------
def test_metrics_count_what_was_sent(served):
    before = _metrics(served)
    sent = []
    for i in range(5):
        docs, query = _docs(served, 300 + i % 2)
        body = dict(prompt="<<PIC_SEP>>".join(docs[::(-1) ** i] + [query]), max_tokens=3 + i, temperature=0)
        sent.append(_post(served, "/v1/completions", body).json()["usage"])
    after = _metrics(served)

    def delta(name, labels=()):
        return after.get((name, labels), 0) - before.get((name, labels), 0)

    assert delta("hypic:prompt_tokens_total") == sum(u["prompt_tokens"] for u in sent)
    assert delta("hypic:generation_tokens_total") == sum(u["completion_tokens"] for u in sent)
    assert delta("hypic:cached_tokens_total") == sum(u["prompt_tokens_details"]["cached_tokens"] for u in sent) > 0
    assert delta("hypic:cold_tokens_total") == sum(u["pic"]["cold_tokens"] for u in sent)
    assert delta("hypic:recomputed_tokens_total") == sum(u["pic"]["recomputed_tokens"] for u in sent)
    assert delta("hypic:cache_hits_total", (("kind", "pic"),)) == sum(u["pic"]["hits"] for u in sent)
    assert delta("hypic:cache_queries_total", (("kind", "pic"),)) == sum(u["pic"]["hits"] + u["pic"]["misses"]
                                                                         for u in sent)
    assert delta("hypic:request_success_total", (("finished_reason", "length"),)) == 5
    assert delta("hypic:time_to_first_token_seconds_count") == 5
    assert delta("hypic:inter_token_latency_seconds_count") == sum(u["completion_tokens"] - 1 for u in sent)
    assert after[("hypic:cache_entries", ())] > 0 and after[("hypic:cache_bytes", ())] > 0
    assert after[("hypic:num_requests_running", ())] == 0


def test_zz_nothing_compiled_while_serving(served):
    """Last in the module: every request above ran on the programs compiled in warmup."""
    assert backend_compiles() == served["compiles"]
    assert _metrics(served)[("hypic:compilations_while_serving_total", ())] == 0
    assert served["engine"].stats["programs"]["serving_compiles"] == 0


# Host-side pieces -----------------------------------------------------------------------------------------------
def test_text_stream_holds_back_a_possible_stop_string(served):
    tok = served["tokenizer"]
    ids = tok.encode("the quick brown fox jumps over", add_special_tokens=False).ids
    stream = TextStream(tok, ("fox j",))
    released = ""
    for t in ids:
        delta, stopped = stream.push(t)
        released += delta
        if stopped:
            break
    assert stopped and released == "the quick brown " and stream.text == released
    plain = TextStream(tok, ())
    assert "".join(plain.push(t)[0] for t in ids) + plain.flush()[0] == tok.decode(ids)


def test_chat_rendering_splits_the_template_per_message():
    template = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    messages = [dict(role="system", content="s"), dict(role="user", content="doc"), dict(role="user", content="q")]
    parts = ChatRenderer(template).render(messages)
    assert parts == ["<|system|>s<|end|>", "<|user|>doc<|end|>", "<|user|>q<|end|><|assistant|>"]
    assert ChatRenderer().render(messages) == ["system: s\n", "user: doc\n", "user: q\nassistant:"]
    rewriting = "{{ messages | length }}{% for m in messages %}{{ m.content }}{% endfor %}"
    assert ChatRenderer(rewriting).render(messages) == ["3sdocq"]  # no per-message split: one segment


def test_a_chat_too_long_for_the_prompt_is_refused_after_one_render():
    """The per-message split renders every prefix of the conversation, a cost that grows with the square of the
    messages (20,000 messages held the event loop for half an hour): a conversation over the prompt limit is
    refused from one rendering of the whole, and one with more messages than prompt tokens before any."""
    from hypic_jax.serve.protocol import Limits, parse_chat

    class Chars:  # one token per character
        def encode(self, text, add_special_tokens=False):
            return type("Encoding", (), dict(ids=[ord(c) % 256 for c in text]))()

    renderer = ChatRenderer("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}")
    renders, real = [], renderer.template.render
    renderer.template.render = lambda **kw: renders.append(len(kw["messages"])) or real(**kw)
    limits = Limits(vocab_size=256, max_prompt_tokens=64, max_keys=80, max_new_tokens=16, max_segments=8,
                    top_logprobs=5)
    for count, rendered in ((40, 1), (300, 0)):
        renders.clear()
        with pytest.raises(ApiError) as caught:
            parse_chat(dict(messages=[dict(role="user", content="ab")] * count), limits, Chars(), renderer)
        assert caught.value.code == "context_length_exceeded" and caught.value.param == "messages"
        assert len(renders) == rendered
    renders.clear()
    parsed = parse_chat(dict(messages=[dict(role="user", content="ab")] * 3), limits, Chars(), renderer)
    assert len(parsed.segments) == 3 and len(renders) == 1 + 3


def test_dummy_load_format_gives_the_folders_shapes_random_weights(tmp_path):
    """`hypic-jax serve MODEL --load-format dummy` (`checkpoint.random_model`): a folder with only the model's
    metadata serves its architecture and config with random weights; without a folder it is refused."""
    import jax

    from hypic_jax import models
    from hypic_jax.checkpoint import random_model, write_metadata
    from hypic_jax.demo import tiny_model
    from hypic_jax.engine import EngineOptions
    from hypic_jax.serve.app import build
    from hypic_jax.serve.model import load_served

    reference = tiny_model()
    write_metadata(tmp_path, model_type="qwen3_5", config=reference.config, dtype="float32")
    model = random_model(tmp_path, "float32")
    assert model.config == reference.config and model.arch is reference.arch
    want = models.abstract_params(reference.arch, reference.config, np.float32)
    assert jax.tree.structure(model.params) == jax.tree.structure(want)
    assert all(a.shape == b.shape and a.dtype == b.dtype
               for a, b in zip(jax.tree.leaves(model.params), jax.tree.leaves(want)))
    assert any(float(np.abs(np.asarray(a)).max()) > 0 for a in jax.tree.leaves(model.params))
    small = EngineOptions.from_kwargs(max_prompt_tokens=32, max_new_tokens=4, max_batch=1, cache_bytes=1 << 22)
    served = load_served(tmp_path, dtype="float32", load_format="dummy", options=small)
    assert served.engine.config == reference.config and served.engine.tokenizer is None
    assert served.engine.model.arch is reference.arch and served.name == tmp_path.name
    served.engine.close()
    with pytest.raises(ValueError, match="hypic-jax checkpoint"):
        load_served(tmp_path / "missing", dtype="float32", load_format="dummy", options=small)
    with pytest.raises(ValueError, match="needs a MODEL folder"):
        build(None, load_format="dummy")
    with pytest.raises(ValueError, match="load_format"):
        load_served(tmp_path, dtype="float32", load_format="fake", options=small)


def test_a_failed_warmup_stops_the_server_with_its_error():
    """A warmup that fails (out of device memory, say) is reported by /health as a 500 naming the error and stops
    the server (`hypic-jax serve` exits 1) instead of answering 503 forever."""
    from starlette.testclient import TestClient

    from hypic_jax.demo import tiny_model

    engine = Engine(tiny_model(), max_prompt_tokens=32, token_rungs=(32,), max_new_tokens=4, max_batch=1,
                    cache_bytes=1 << 22)

    def out_of_memory(**_):
        raise RuntimeError("RESOURCE_EXHAUSTED: out of memory")

    engine.warmup = out_of_memory
    server = Server(engine, model_name=MODEL)
    stopped = threading.Event()
    server.on_warmup_failure = lambda error: stopped.set()
    with TestClient(server.app) as client:
        assert stopped.wait(30)
        health = client.get("/health")
    assert health.status_code == 500 and "out of memory" in health.json()["error"]
    assert not server.ready


def test_gpu_memory_fraction_sets_jax_share_before_the_backend_starts(monkeypatch):
    """`hypic-jax serve --gpu-memory-fraction F` sets XLA_PYTHON_CLIENT_MEM_FRACTION for the process (the flag wins
    over the environment; without either, the server's default); a value outside (0, 1] is refused."""
    from hypic_jax import cli
    from hypic_jax.serve import app

    seen = []
    monkeypatch.setattr(app, "main", lambda args: seen.append(__import__("os").environ.get(
        "XLA_PYTHON_CLIENT_MEM_FRACTION")) or 0)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    assert cli.main(["serve"]) == 0
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.6")
    assert cli.main(["serve"]) == 0
    assert cli.main(["serve", "--gpu-memory-fraction", "0.95"]) == 0
    assert seen == [f"{cli.DEFAULT_GPU_MEMORY_FRACTION:g}", "0.6", "0.95"]
    with pytest.raises(SystemExit):
        cli.main(["serve", "--gpu-memory-fraction", "1.5"])


def test_the_compile_cache_defaults_to_a_per_user_folder(monkeypatch, tmp_path, caplog):
    """`hypic-jax serve` keeps compiled programs in $HYPIC_JAX_CACHE, else $XDG_CACHE_HOME/hypic-jax, else
    ~/.cache/hypic-jax; `--compile-cache DIR` names another and `--compile-cache none` keeps none. A default folder
    that cannot be made leaves the engine without a compile cache, with a warning."""
    from hypic_jax import cli
    from hypic_jax.demo import tiny_model
    from hypic_jax.serve import app

    seen, options = [], []
    monkeypatch.setattr(app, "main", lambda args: options.append(args.engine_options) or seen.append(
        args.engine_options.compile.folder()) or 0)
    monkeypatch.delenv("HYPIC_JAX_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cli.main(["serve"]) == 0
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cli.main(["serve"]) == 0
    monkeypatch.setenv("HYPIC_JAX_CACHE", str(tmp_path / "mine"))
    assert cli.main(["serve"]) == 0
    assert cli.main(["serve", "--compile-cache", str(tmp_path / "flag")]) == 0
    assert cli.main(["serve", "--compile-cache", "none"]) == 0
    assert seen == [tmp_path / "xdg" / "hypic-jax", tmp_path / "home" / ".cache" / "hypic-jax", tmp_path / "mine",
                    tmp_path / "flag", None]
    # a default folder that cannot be made: a warning when the engine is built, and no cache
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("HYPIC_JAX_CACHE", str(tmp_path / "file" / "under"))
    assert cli.main(["serve"]) == 0
    with caplog.at_level("WARNING", logger="hypic_jax.engine"):
        engine = Engine(tiny_model(), options[-1], max_prompt_tokens=32, max_new_tokens=4, max_batch=1,
                        cache_bytes=1 << 22)
    assert engine.compile_cache is None and engine.executables is None
    assert "no compile cache" in caplog.text
    engine.close()


def test_warmup_out_of_device_memory_says_what_the_engine_holds():
    """A warmup that runs out of device memory raises DeviceMemoryError naming the weights, pools and decode rows
    the engine holds and what to change; other errors pass through as they are."""
    from hypic_jax.demo import tiny_model
    from hypic_jax.engine import DeviceMemoryError

    engine = Engine(tiny_model(), max_prompt_tokens=32, token_rungs=(32,), max_new_tokens=4, max_batch=2,
                    cache_bytes=1 << 22)

    def exhausted(*_, **__):
        raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 3.67GiB")

    engine._warmup = exhausted
    with pytest.raises(DeviceMemoryError, match="of weights.*of entry pools.*decode rows.*cache-gb"):
        engine.warmup(progress=False)

    def broken(*_, **__):
        raise ValueError("something else")

    engine._warmup = broken
    with pytest.raises(ValueError, match="something else"):
        engine.warmup(progress=False)


def test_overlapped_decode_steps_give_the_same_tokens():
    """With decode steps chained on the device (`Scheduler(overlap=True)`) every request gets the
    tokens, log-probabilities and finish reasons it gets with each step read back before the next: greedy and
    seeded sampled rows, stop ids that end rows while a step for them is in flight, lengths that free the highest
    row (a smaller bucket), and admissions between steps. So do streams moved into lower rows (`compact_rows`)
    and cold prefills spread in pieces."""
    from hypic_jax.demo import tiny_model
    from hypic_jax.engine import SamplingParams
    from hypic_jax.engine.requests import seam_tokens
    from hypic_jax.engine.scheduler import Request, Scheduler

    engine = Engine(tiny_model(), max_prompt_tokens=64, token_rungs=(64,), max_new_tokens=MAX_NEW, max_batch=4,
                    seam=SEAM, cache_bytes=1 << 24)
    engine.warmup(progress=False)
    rng = np.random.default_rng(11)
    specs = []
    for i in range(10):
        segments = [rng.integers(3, 200, int(n)).tolist() for n in rng.integers(2, 20, rng.integers(1, 4))]
        params = SamplingParams(max_tokens=int(rng.integers(1, MAX_NEW + 1)),
                                temperature=float(rng.choice([0.0, 0.8, 1.3])), top_p=float(rng.choice([1.0, 0.9])),
                                top_k=int(rng.choice([0, 5])), seed=int(rng.integers(1 << 30)),
                                logprobs=2 if i % 4 == 0 else None)
        specs.append((segments, params))

    def run(overlap: bool, chunk: int | None = None, salt: str | None = None,
            mode: str = "transition_rope_recompute", compact: bool = False) -> list:
        scheduler = Scheduler(engine, overlap=overlap, prefill_chunk=chunk, compact_rows=compact)
        events = schedule_all(scheduler, specs, mode=mode, seam=SEAM, cache_salt=salt)
        out = []
        for es, (segments, _) in zip(events, specs):
            end = es[-1]
            assert end["type"] == "done", end
            if chunk and mode != "prefix_cache":  # a fresh salt: each request computed its own segments
                stats, docs = end["stats"], [d for d in segments[:-1] if len(d) > seam_tokens(SEAM, len(d))]
                assert (stats.cached_tokens, stats.hits) == (0, 0), stats
                assert (stats.cold_tokens, stats.misses) == (sum(map(len, docs)), len(docs)), stats
            logprobs = [lp for e in es if e["type"] == "delta" and e["logprobs"] for lp in e["logprobs"]]
            out.append((end["tokens"], end["finish_reason"], logprobs))
        return out, scheduler

    first, _ = run(False)
    for k, ((tokens, _, _), (segments, params)) in enumerate(zip(first, specs)):
        if k % 3 == 0 and len(tokens) >= 3:  # a stop id that ends the row mid-way
            specs[k] = (segments, dataclasses.replace(params, stop_token_ids=frozenset({tokens[1]})))
    chained, overlapped = run(True)
    plain, _ = run(False)
    assert overlapped.chained_steps > 0, (overlapped.chained_steps, overlapped.steps)
    for k, ((a_tokens, a_reason, a_lp), (b_tokens, b_reason, b_lp)) in enumerate(zip(chained, plain)):
        assert a_tokens == b_tokens and a_reason == b_reason, k
        assert len(a_lp) == len(b_lp)
        for (ta, ca, topa), (tb, cb, topb) in zip(a_lp, b_lp):
            assert ta == tb and abs(ca - cb) < 1e-5 and [t for t, _ in topa] == [t for t, _ in topb], k
    assert any(reason == "stop" for _, reason, _ in plain), plain
    # streams moved into lower free rows when that shrinks the bucket: the same tokens again
    for overlap in (False, True):
        moved, compacted = run(overlap, compact=True)
        assert compacted.rows_moved > 0, compacted.steps
        for k, ((a_tokens, a_reason, a_lp), (b_tokens, b_reason, b_lp)) in enumerate(zip(moved, plain)):
            assert a_tokens == b_tokens and a_reason == b_reason, (overlap, k)
            for (ta, ca, _), (tb, cb, _) in zip(a_lp, b_lp):
                assert ta == tb and abs(ca - cb) < 1e-5, (overlap, k)
    # cold prefills spread in pieces of one segment between decode steps: the same tokens again
    for overlap in (False, True):
        pieces, spread = run(overlap, chunk=1, salt=f"pieces-{overlap}")
        assert spread.prefill_pieces > 0, spread.steps
        for k, ((a_tokens, a_reason, a_lp), (b_tokens, b_reason, b_lp)) in enumerate(zip(pieces, plain)):
            assert a_tokens == b_tokens and a_reason == b_reason, (overlap, k)
            for (ta, ca, _), (tb, cb, _) in zip(a_lp, b_lp):
                assert ta == tb and abs(ca - cb) < 1e-5, (overlap, k)
    # prefix_cache: the leading segments after the cached run, recorded in pieces; prefix reuse is exact
    whole, _ = run(False, salt="prefix-whole", mode="prefix_cache")
    pieces, spread = run(True, chunk=1, salt="prefix-pieces", mode="prefix_cache")
    assert spread.prefill_pieces > 0, spread.steps
    for k, ((a_tokens, a_reason, a_lp), (b_tokens, b_reason, b_lp)) in enumerate(zip(pieces, whole)):
        assert a_tokens == b_tokens and a_reason == b_reason, k
        for (ta, ca, _), (tb, cb, _) in zip(a_lp, b_lp):
            assert ta == tb and abs(ca - cb) < 1e-4, k
    # a lone request that ends by its length costs no step beyond its last token
    assert engine.scheduler.overlap is False  # derived: off where the device is the CPU
    lone = Scheduler(engine, overlap=True)
    finished = threading.Event()
    lone.start()
    try:
        lone.submit(Request(specs[1][0], dataclasses.replace(specs[1][1], max_tokens=6),
                            lambda event: event["type"] in ("done", "error") and finished.set()))
        assert finished.wait(60)
    finally:
        lone.stop()
    assert lone.steps == 5 and lone.chained_steps == 4, (lone.steps, lone.chained_steps)


def test_a_restarted_server_serves_its_entries_from_the_disk_tier(tmp_path, tiny_checkpoints):
    """A server with a disk tier writes its cache there on a graceful shutdown; a new server on the same folder
    answers the same documents (reordered) from it: cached tokens, no cold prefill, the first server's answer."""
    from starlette.testclient import TestClient

    model, vocab, _ = tiny_checkpoints("qwen_dense")
    tokenizer = _tokenizer(vocab)
    docs, query = _docs(dict(), 7)
    lengths = [len(tokenizer.encode(d, add_special_tokens=False).ids) for d in docs]
    answers, donor = [], None
    for order in ([0, 1, 2], [2, 0, 1]):
        engine = Engine(model, tokenizer=tokenizer, max_prompt_tokens=128, token_rungs=(128,), max_segments=8,
                        max_new_tokens=4, max_batch=1, cache_bytes=1 << 24, seam=SEAM,
                        disk_cache_dir=str(tmp_path / "disk"))
        if donor is not None:  # the same shapes: the first server's compiled programs
            engine.programs._compiled.update(donor.programs._compiled)
            engine.mover.adopt(donor.mover)
        server = Server(engine, model_name=MODEL, warm_on_start=False)
        with TestClient(server.app) as client:
            server.warmup()
            prompt = "<<PIC_SEP>>".join([docs[i] for i in order] + [query])
            reply = client.post("/v1/completions", json=dict(model=MODEL, prompt=prompt, max_tokens=4,
                                                                temperature=0)).json()
        answers.append(reply)
        donor = engine
    first, second = answers
    assert first["usage"]["pic"]["misses"] == 3 and first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["pic"]["hits"] == 3 and second["usage"]["pic"]["cold_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == sum(n - SEAM for n in lengths)
    assert donor.stats["tiers"]["promotions"]["disk"] == 3
    # the reordered prompt: the same entries, so the greedy answer matches a fresh engine's on that order
    reference = Engine(model, tokenizer=tokenizer, max_prompt_tokens=128, token_rungs=(128,), max_segments=8,
                       max_new_tokens=4, max_batch=1, cache_bytes=1 << 24, seam=SEAM)
    reference.programs._compiled.update(donor.programs._compiled)
    want = reference.generate([docs[2], docs[0], docs[1], query], max_new_tokens=4)
    assert second["choices"][0]["text"] == tokenizer.decode(want.tokens)


def test_a_stream_torn_down_before_its_first_byte_still_cancels_its_request():
    """The response cancels its request however it ends: the stream's generator cancels in its `finally`, which a
    generator that never started does not run (a client gone while the response sends its headers would leave the
    request decoding to its token limit)."""
    from hypic_jax.serve.app import EventStream

    started, closed = [], []

    async def body():
        started.append(True)
        yield "data: x\n\n"

    async def gone(message):  # the client left: sending the headers fails
        raise OSError("connection reset")

    async def receive():
        await asyncio.sleep(3600)

    from starlette.requests import ClientDisconnect

    response = EventStream(body(), lambda: closed.append(True), media_type="text/event-stream")
    with pytest.raises(ClientDisconnect):
        asyncio.run(response(dict(type="http", asgi={"spec_version": "2.4"}), receive, gone))
    assert closed == [True] and not started


@pytest.mark.xdist_group("serve-defaults")
def test_serve_with_no_flags_fits_a_checkpoint_of_4096_tokens(tmp_path):
    """`hypic-jax serve MODEL` with no flag on a checkpoint whose context is 4,096 tokens: the limits derived from
    the model fit its context, and the server becomes healthy (the larger rungs compiling in the background)."""
    from starlette.testclient import TestClient

    from hypic_jax import cli
    from hypic_jax.options import from_args
    from hypic_jax.serve import ServerOptions, build

    _, _, folder = tiny_checkpoint("qwen_dense", str(tmp_path / "model"))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(config, max_position_embeddings=4096)))
    args = cli.parser().parse_args(["serve", str(folder)])
    server = build(args.model, dtype=args.dtype, options=cli.engine_options(args), server=from_args(ServerOptions, args))
    engine = server.engine
    assert engine.max_context == 4096 and engine.max_prompt_tokens + engine.max_new_tokens <= 4096
    server.warmup()
    health = TestClient(server.app).get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    out = engine.generate([[5, 6, 7], [8, 9]], max_new_tokens=3)
    assert len(out.tokens) == 3
    server.close()


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals reach the main thread")
def test_sigterm_drains_accepted_requests_refuses_new_ones_and_persists(served, tmp_path, monkeypatch):
    """The first SIGTERM: /health and new requests answer 503 while the accepted stream and the queued request
    finish whole; then the server stops, writes its entries to the disk tier and returns without re-raising the
    signal (the process exits 0). A server on its own engine (the module's compiled programs), run by
    `graceful_uvicorn` on this thread, where signals arrive."""
    import os
    import signal

    from hypic_jax.serve import ServerOptions
    from hypic_jax.serve.app import graceful_uvicorn

    donor = served["engine"]
    engine = Engine(donor.model, tokenizer=served["tokenizer"], max_prompt_tokens=128, token_rungs=(128,),
                    max_segments=8, max_new_tokens=MAX_NEW, max_batch=4, cache_bytes=1 << 24, seam=SEAM,
                    max_queue=128, disk_cache_dir=str(tmp_path / "disk"))
    engine.programs._compiled.update(donor.programs._compiled)
    engine.mover.adopt(donor.mover)
    server = Server(engine, ServerOptions(shutdown_timeout=60), model_name=MODEL, warm_on_start=False)
    server.warmup()
    real = engine.slot_decode

    def slow(*args, **kwargs):  # decode steps long enough to see the drain from outside
        time.sleep(0.1)
        return real(*args, **kwargs)

    monkeypatch.setattr(engine, "slot_decode", slow)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    runner = graceful_uvicorn(server, uvicorn.Config(server.app, host="127.0.0.1", port=port, log_level="warning"))
    base, seen = f"http://127.0.0.1:{port}", {}

    def client():
        try:
            while not runner.started:
                time.sleep(0.02)
            docs, query = _docs(dict(), 11)
            body = dict(model=MODEL, prompt="<<PIC_SEP>>".join(docs + [query]), max_tokens=MAX_NEW,
                        temperature=0, stream=True, return_token_ids=True)
            with httpx.Client(base_url=base, timeout=60) as http:
                queued = threading.Thread(target=lambda: seen.setdefault("queued", http.post(
                    "/v1/completions", json=dict(prompt=[7, 8, 9], max_tokens=4, temperature=0))))
                with http.stream("POST", "/v1/completions", json=body) as response:
                    lines = response.iter_lines()
                    chunks = [next(line for line in lines if line.startswith("data: "))]
                    queued.start()
                    while server.scheduler.running < 2 and server.scheduler.waiting < 1:
                        time.sleep(0.01)
                    os.kill(os.getpid(), signal.SIGTERM)
                    while not server.draining:
                        time.sleep(0.01)
                    seen["health"] = http.get("/health")
                    seen["new"] = http.post("/v1/completions", json=dict(prompt=[1, 2, 3], max_tokens=2))
                    chunks += [line for line in lines if line.startswith("data: ")]
                queued.join(60)
            seen["chunks"] = chunks
        except BaseException as error:  # noqa: BLE001  (reported by the test below)
            seen["error"] = error
            runner.should_exit = True

    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    runner.run()  # returns once drained and stopped
    thread.join(60)
    assert "error" not in seen, seen.get("error")
    assert seen["health"].status_code == 503 and seen["health"].json()["status"] == "draining"
    assert seen["new"].status_code == 503 and seen["new"].json()["error"]["code"] == "shutting_down"
    chunks = seen["chunks"]
    assert chunks[-1] == "data: [DONE]"
    tokens = [t for c in chunks[:-1] for choice in json.loads(c[6:])["choices"]
              for t in choice.get("token_ids") or []]
    assert len(tokens) == MAX_NEW and json.loads(chunks[-2][6:])["choices"][0]["finish_reason"] == "length"
    assert seen["queued"].status_code == 200 and seen["queued"].json()["usage"]["completion_tokens"] == 4
    assert runner._captured_signals == []  # uvicorn re-raises a captured signal after it stops: none here
    assert engine.tiers.disk.stats.entries >= 3  # the three documents reached the disk tier on close


def test_a_short_soak_answers_every_request_and_compiles_nothing(served):
    """`bench/soak.py`'s traffic at a short size against the module's server: PIC, prefix and full requests over
    a growing pool, salts, streams, streams left early and bad inputs; every request is answered (bad inputs with
    a 4xx in OpenAI's shape), none is lost, nothing compiles. Its length is HYPIC_SOAK_MINUTES (default 0.2, the
    CI's size; `HYPIC_SOAK_MINUTES=5 pytest tests/test_serve.py -k soak` is the five-minute run, which also bounds
    the growth of the process's memory floor, memory maps and open files after its first minute by 5%). The
    hour-long run, with its resource slopes, is the benchmark (bench/RESULTS.md, "soak.py")."""
    import importlib.util
    import os
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("soak", Path(__file__).parents[1] / "bench" / "soak.py")
    soak = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(soak)
    minutes = float(os.environ.get("HYPIC_SOAK_MINUTES", "0.2"))
    every = 4 if minutes < 1 else 15
    args = soak.parser().parse_args(["--minutes", str(minutes), "--sample-every", str(every), "--rate", "5",
                                     "--docs", "2", "--doc-tokens", "24", "--query-tokens", "8", "--max-tokens", "8",
                                     "--vocab", str(served["vocab"]), "--bad", "0.15", "--cancel", "0.15",
                                     "--request-timeout", "60"])
    samples, outcomes = asyncio.run(soak.drive(args, served["base"], os.getpid()))
    lost = {k: v for k, v in outcomes.items() if k.startswith("unanswered") or "without" in k or "status" in k
            or "error" in k or (k.startswith("bad input") and "4xx" not in k)}
    assert not lost, outcomes
    assert outcomes["answered"] > 0 and outcomes["bad input answered 4xx"] > 0
    assert len(samples) >= 3 and samples[-1]["requests"] == sum(outcomes.values())
    # the counter is the process's (other modules' tests may have compiled in it before): nothing during the soak
    assert samples[-1]["compiles"] == samples[0]["compiles"]
    assert set(soak.growth(samples, 0.0)) >= set(soak.RESOURCES)
    if minutes >= 2:
        grown = soak.growth(samples, 1.0)
        assert all(grown[key]["floor_growth"] < 0.05 for key in ("rss_mb", "maps", "open_files")), grown


def test_a_prefill_out_of_device_memory_is_a_400_naming_the_limits(served, monkeypatch):
    """A request whose prefill runs out of device memory is refused with a 400 that names the server's limits;
    the server goes on serving."""
    engine = served["engine"]
    real = engine.prefill

    def exhausted(*args, **kwargs):
        raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1073741824 bytes.")

    monkeypatch.setattr(engine, "prefill", exhausted)
    response = _post(served, "/v1/completions", dict(segments=[[5, 6, 7], [8, 9]], max_tokens=2, temperature=0))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "device_memory" and f"up to {engine.max_prompt_tokens} prompt tokens" in error["message"]
    monkeypatch.setattr(engine, "prefill", real)
    ok = _post(served, "/v1/completions", dict(segments=[[5, 6, 7], [8, 9]], max_tokens=2, temperature=0))
    assert ok.status_code == 200


def test_the_stall_is_measured_against_a_gap_no_prefill_lengthened():
    """`hypic:decode_stall_seconds`: the gap across a prefill issued while streams run, less the last plain gap.
    A prefill issued while no stream runs delays none, and the gap to the next read must not become the plain gap
    (it would hide every stall measured against it)."""
    from types import SimpleNamespace

    from hypic_jax.demo import tiny_model
    from hypic_jax.engine.scheduler import Scheduler

    scheduler = Scheduler(Engine(tiny_model(), max_prompt_tokens=64, token_rungs=(64,), max_new_tokens=4,
                                 max_batch=2, cache_bytes=1 << 22))
    stalls = []
    scheduler.metrics = SimpleNamespace(stall=SimpleNamespace(observe=stalls.append))
    scheduler._time_read(0.00)
    scheduler._time_read(0.01)  # a plain gap of 10 ms
    scheduler._mark_stall()  # nothing runs: an admission that delays no stream
    scheduler._time_read(1.00)  # the admitted stream's first read, a second later
    assert stalls == [] and abs(scheduler._plain_gap - 0.01) < 1e-9
    scheduler.rows[0] = SimpleNamespace()  # a stream runs: the next prefill delays its next read
    scheduler._mark_stall()
    scheduler._time_read(1.30)
    assert len(stalls) == 1 and abs(stalls[0] - 0.29) < 1e-9, stalls
    scheduler._time_read(1.31)  # plain again
    assert len(stalls) == 1 and abs(scheduler._plain_gap - 0.01) < 1e-9
