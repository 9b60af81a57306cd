"""A byte-level BPE tokenizer trained on the generated corpus, and the token layout of a prompt.

A prompt is tokenized segment by segment, as the engine receives it: each document as `<|doc|> text\n`, then the
questions as `<|q|> question<|a|> answer<|eos|>`. The model learns to answer after `<|a|>` and to stop with
`<|eos|>`; the loss counts only the answer tokens and the `<|eos|>` after them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hypic_jax.train import corpus

PAD, DOC, QUESTION, ANSWER, EOS = "<|pad|>", "<|doc|>", "<|q|>", "<|a|>", "<|eos|>"
SPECIAL_TOKENS = (PAD, DOC, QUESTION, ANSWER, EOS)


def train_tokenizer(vocab_size: int = 2048, seed: int = 0, prompts: int = 400,
                    families: tuple[str, ...] = corpus.FAMILIES):
    """BPE on generated text of prompts of `families` (special tokens first: ids 0-4)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus.sample_text(seed, prompts, families), trainer=trainer)
    return tokenizer


def load_tokenizer(path: str | Path):
    from tokenizers import Tokenizer

    path = Path(path)
    return Tokenizer.from_file(str(path / "tokenizer.json" if path.is_dir() else path))


# Chat messages in the prompt layout the model is trained on: the last user message (with the generation prompt)
# is the question, `<|q|> question<|a|>`; a user message answered by the next assistant message is an earlier
# question and the assistant message its answer; every other message (system prompts, documents, earlier user
# turns) is a document, `<|doc|> text\n`. Rendered message by message, a conversation of documents and one
# question gives one segment per document, as the engine caches them.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message.role == 'assistant' -%}{{ ' ' + message.content + '" + EOS + "' }}"
    "{%- elif (loop.last and add_generation_prompt) or (not loop.last and messages[loop.index0 + 1].role == "
    "'assistant') -%}{{ '" + QUESTION + " ' + message.content + '" + ANSWER + "' }}"
    "{%- else -%}{{ '" + DOC + " ' + message.content + '\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
)


def special_ids(tokenizer) -> dict[str, int]:
    return {t: tokenizer.token_to_id(t) for t in SPECIAL_TOKENS}


def document_text(document: str) -> str:
    return f"{DOC} {document}\n"


def question_text(question: str) -> str:
    return f"{QUESTION} {question}{ANSWER}"


def answer_text(answer: str) -> str:
    return f" {answer}{EOS}"


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


def encode_prompt(tokenizer, prompt: corpus.Prompt, max_tokens: int | None = None) -> tuple[list[list[int]], list[int]]:
    """(document segments as token lists, question segment tokens) and the loss mask of the question segment
    (1 on answer tokens and their <|eos|>). With max_tokens, trailing questions that do not fit are dropped; a
    ValueError says when not even the first one fits after the documents."""
    docs = [encode(tokenizer, document_text(d)) for d in prompt.documents]
    pairs = [(encode(tokenizer, question_text(q.text)), encode(tokenizer, answer_text(q.answer)))
             for q in prompt.questions]
    doc_tokens = sum(map(len, docs))
    if max_tokens is not None:
        room = max_tokens - doc_tokens
        kept = []
        for q, a in pairs:
            if len(q) + len(a) > room:
                break
            kept.append((q, a))
            room -= len(q) + len(a)
        if not kept:
            raise ValueError(f"the documents alone take {doc_tokens} of {max_tokens} tokens")
        pairs = kept
    tokens, mask = [], []
    for q, a in pairs:
        tokens += q + a
        mask += [0] * len(q) + [1] * len(a)
    return docs, (tokens, mask)


def pack(segments: list[list[int]], question: tuple[list[int], list[int]], length: int, pad_id: int
         ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One row of training data: (inputs [length], targets [length], loss weights [length]); target t is the
    token after input t, padded with pad_id and weight 0."""
    q_tokens, q_mask = question
    tokens = [t for s in segments for t in s] + q_tokens
    mask = [0] * (len(tokens) - len(q_tokens)) + q_mask
    if len(tokens) > length + 1:
        raise ValueError(f"prompt of {len(tokens)} tokens does not fit a row of {length} + 1")
    tokens = tokens + [pad_id] * (length + 1 - len(tokens))
    mask = mask + [0] * (length + 1 - len(mask))
    tokens = np.asarray(tokens, np.int32)
    return tokens[:-1], tokens[1:], np.asarray(mask[1:], np.float32)
