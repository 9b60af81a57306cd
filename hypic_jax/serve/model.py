"""What `hypic-jax serve` serves: a model folder, or with none the default model (`default_model`, the one place
that choice is made: the embedded model when it is installed), with the tokenizer, chat template and
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
    model: Any  # hypic_jax.models.base.Model
    name: str
    tokenizer: Any = None
    chat_template: str | None = None
    special_tokens: dict = dataclasses.field(default_factory=dict)  # bos_token / eos_token for the template
    eos_ids: tuple[int, ...] = ()
    max_context: int | None = None
    source: str | None = None


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


def default_model(dtype: str = "bfloat16") -> Served:
    """The model served when no MODEL is given: the model embedded in the package (`hypic_jax.embedded`) when it is
    installed, else the demo's tiny model with random weights (its answers are noise) and a byte-level tokenizer, so
    that a fresh machine can run the server."""
    from hypic_jax.embedded import embedded_model

    folder = embedded_model()
    if folder is not None:
        log.info("no MODEL given: serving the embedded model %s", folder.name)
        return load_folder(folder, dtype)
    from hypic_jax.demo import tiny_model

    log.warning("no MODEL given: serving %r, the demo's tiny model with RANDOM weights (3 GDN + 1 full-attention "
                "layers, vocabulary 512, byte-level tokenizer); its output is noise", DEFAULT_NAME)
    return Served(model=tiny_model(), name=DEFAULT_NAME, tokenizer=byte_tokenizer())


def load_folder(path: str | Path, dtype: str = "bfloat16", load_format: str = "auto", mesh=None) -> Served:
    """A model folder as `Engine.from_pretrained` reads it, plus tokenizer_config.json's chat template and special
    tokens and the end-of-sequence ids of generation_config.json (else config.json or the eos token). A folder
    without a chat template whose tokenizer has hypic_jax.train's special tokens gets that layout's template
    (`hypic_jax.train.tokenizer.CHAT_TEMPLATE`). load_format "dummy": random weights of the folder's architecture
    and config (`hypic_jax.checkpoint.random_model`), the rest of the folder read as usual. mesh: load the
    parameters split over it (`hypic_jax.load(mesh=...)`, `random_model(mesh=...)`)."""
    from hypic_jax.checkpoint import random_model
    from hypic_jax.models import load

    if load_format not in ("auto", "dummy"):
        raise ValueError(f"load_format must be 'auto' or 'dummy', got {load_format!r}")
    path = Path(path)
    if load_format == "dummy":
        log.warning("--load-format dummy: serving %s with RANDOM weights (its output is noise)", path.name)
        model = random_model(path, dtype, mesh=mesh)
    else:
        model = load(path, dtype, mesh=mesh)
    tokenizer = None
    if (path / "tokenizer.json").exists():
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
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
    return Served(model=model, name=path.name, tokenizer=tokenizer, chat_template=template, special_tokens=special,
                  eos_ids=tuple(int(e) for e in eos_ids),
                  max_context=int(config["max_position_embeddings"]) if config.get("max_position_embeddings") else None,
                  source=f"{path.resolve()}:{dtype}")


def _qa_tokens(tokenizer) -> bool:
    """Whether the tokenizer has the special tokens of hypic_jax.train's prompt layout (<|doc|>, <|q|>, <|a|>)."""
    from hypic_jax.train import tokenizer as qa

    return all(tokenizer.token_to_id(t) is not None for t in (qa.DOC, qa.QUESTION, qa.ANSWER))


def _json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}
