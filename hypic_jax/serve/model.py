"""What `hypic-jax serve` serves: the engine over a model folder, or with none the default model (`load_served`, the
one place that choice is made: the embedded model when it is installed), with the chat template and
end-of-sequence ids found beside it."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger("hypic_jax.serve")

DEFAULT_NAME = "hypic-tiny-random"


@dataclasses.dataclass
class Served:
    engine: Any  # hypic_jax.engine.Engine
    name: str
    chat_template: str | None = None
    special_tokens: dict = dataclasses.field(default_factory=dict)  # bos_token / eos_token for the template
    eos_ids: tuple[int, ...] = ()


def byte_tokenizer():
    """A byte-level tokenizer with no merges: ids 0-255 are the bytes, any text round-trips."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_order = sorted(alphabet, key=lambda ch: _byte_of(ch))
    tokenizer = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(byte_order)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _byte_of(ch: str) -> int:
    """GPT-2's byte -> printable character map, inverted for one character."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table[ch]


def load_served(path: str | Path | None, *, dtype: str = "bfloat16", load_format: str = "auto",
                quantize: str | None = None, options=None) -> Served:
    """The engine over a model folder (`Engine.from_pretrained`) and what the server reads beside it:
    tokenizer_config.json's chat template and special tokens and the end-of-sequence ids of generation_config.json
    (else config.json or the eos token). A folder without a chat template whose tokenizer has hypic_jax.train's
    special tokens gets that layout's template (`hypic_jax.train.tokenizer.CHAT_TEMPLATE`). Without a path: the
    model embedded in the package when it is installed, else the demo's tiny model with random weights (its output
    is noise) and a byte-level tokenizer, so that a fresh machine can run the server."""
    from hypic_jax.engine import Engine

    if path is None:
        from hypic_jax.checkpoint.embedded import embedded_model

        path = embedded_model()
        if path is None:
            from hypic_jax.demo import tiny_model

            log.warning("no MODEL given: serving %r, the demo's tiny model with RANDOM weights (3 GDN + 1 "
                        "full-attention layers, vocabulary 512, byte-level tokenizer); its output is noise",
                        DEFAULT_NAME)
            model = tiny_model()
            if quantize == "fp8":
                from hypic_jax.models import quantize_params

                model = model.replace(params=quantize_params(model.arch, model.params))
            engine = Engine(model, options, tokenizer=byte_tokenizer(), consume_model=True)
            return Served(engine=engine, name=DEFAULT_NAME)
        log.info("no MODEL given: serving the embedded model %s", path.name)
    path = Path(path)
    if load_format == "dummy":
        log.warning("--load-format dummy: serving %s with RANDOM weights (its output is noise)", path.name)
    engine = Engine.from_pretrained(path, dtype, options=options, load_format=load_format, quantize=quantize)
    tokenizer = engine.tokenizer
    config = _json(path / "config.json")
    config = config.get("text_config") or config
    tok_config = _json(path / "tokenizer_config.json")
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    if template is None and (path / "chat_template.jinja").exists():
        template = (path / "chat_template.jinja").read_text()
    if template is None and tokenizer is not None and _qa_tokens(tokenizer):
        from hypic_jax.train import tokenizer as qa

        template = qa.CHAT_TEMPLATE  # a model of hypic_jax.train: its documents-then-question layout
    special = {}
    for name in ("bos_token", "eos_token"):
        value = tok_config.get(name)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            special[name] = value
    eos = _json(path / "generation_config.json").get("eos_token_id", config.get("eos_token_id"))
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    if not eos_ids and tokenizer is not None and special.get("eos_token"):
        found = tokenizer.token_to_id(special["eos_token"])
        eos_ids = [] if found is None else [found]
    return Served(engine=engine, name=path.name, chat_template=template, special_tokens=special,
                  eos_ids=tuple(int(e) for e in eos_ids))


def _qa_tokens(tokenizer) -> bool:
    """Whether the tokenizer has the special tokens of hypic_jax.train's prompt layout (<|doc|>, <|q|>, <|a|>)."""
    from hypic_jax.train import tokenizer as qa

    return all(tokenizer.token_to_id(t) is not None for t in (qa.DOC, qa.QUESTION, qa.ANSWER))


def _json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}
