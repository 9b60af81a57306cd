"""OpenAI request bodies -> validated segments and sampling parameters; chat rendering; log-probability blocks.

Every bad input raises `ApiError` (400 unless said otherwise) whose `param` names the field. Segments of a
completion: the `segments` extension (strings or token-id lists), else `prompt` (a string split on the server's
separator, or one list of token ids). Segments of a chat: one per message (and one per entry of the `documents`
extension, rendered as user messages right after the leading system messages), each rendered with the model's chat
template when it has one (the text a message adds to the conversation's rendering), else as "role: content\n";
the last segment, the query, ends with the generation prompt ("assistant:" without a template).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from hypic_jax.engine.options import MODES
from hypic_jax.engine.requests import SamplingParams, seam_tokens, segment_seams
from hypic_jax.engine.scheduler import RequestError as ApiError

ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclasses.dataclass
class Limits:
    """What the served engine accepts."""

    vocab_size: int
    max_prompt_tokens: int
    max_keys: int  # prompt + generated tokens
    max_new_tokens: int
    max_segments: int
    top_logprobs: int
    eos_ids: tuple[int, ...] = ()  # stop ids unless a request sets ignore_eos


@dataclasses.dataclass
class Parsed:
    segments: list[list[int]]
    params: SamplingParams
    stream: bool
    include_usage: bool
    mode: str | None
    seam: float | tuple | None
    cache_salt: str | None
    return_token_ids: bool
    timeout: float | None


# Field checks ---------------------------------------------------------------------------------------------------
def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return (isinstance(x, (int, float)) and not isinstance(x, bool)) and math.isfinite(x)


def _get(body: dict, name: str, kind: str, default=None):
    """body[name] checked against `kind` (int | number | bool | str | list | dict); null means absent."""
    value = body.get(name)
    if value is None:
        return default
    ok = {"int": _is_int, "number": _is_number, "bool": lambda v: isinstance(v, bool),
          "str": lambda v: isinstance(v, str), "list": lambda v: isinstance(v, list),
          "dict": lambda v: isinstance(v, dict)}[kind](value)
    if not ok:
        names = {"int": "an integer", "number": "a number", "bool": "a boolean", "str": "a string", "list": "an array",
                 "dict": "an object"}
        raise ApiError(400, f"'{name}' must be {names[kind]}, got {type(value).__name__} {value!r:.60}", param=name,
                       code="invalid_type")
    return value


def _token_ids(value, param: str, vocab: int) -> list[int]:
    if not value:
        raise ApiError(400, f"'{param}' is empty", param=param, code="empty")
    for t in value:
        if not _is_int(t):
            raise ApiError(400, f"'{param}' must hold integer token ids, got {t!r:.40}", param=param,
                           code="invalid_type")
        if not 0 <= t < vocab:
            raise ApiError(400, f"'{param}' holds token id {t}, outside the vocabulary [0, {vocab})", param=param,
                           code="invalid_token_id")
    return list(value)


def _unicode(text: str, param: str) -> str:
    """`text` unless it holds a lone surrogate (JSON's "\\ud800" escapes decode to one), which neither the tokenizer
    nor the cache keys' UTF-8 can take."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ApiError(400, f"'{param}' is not valid Unicode: a lone surrogate {text[error.start]!r} at character "
                       f"{error.start}", param=param, code="invalid_value") from None
    return text


def _encode(text: str, tokenizer, param: str) -> list[int]:
    if tokenizer is None:
        raise ApiError(400, f"'{param}' is text, but the served model has no tokenizer: send token ids (a list of "
                       "integers) instead", param=param, code="no_tokenizer")
    return list(tokenizer.encode(_unicode(text, param), add_special_tokens=False).ids)


def _segment(value, param: str, tokenizer, vocab: int) -> list[int]:
    if isinstance(value, str):
        ids = _encode(value, tokenizer, param)
        if not ids:
            raise ApiError(400, f"'{param}' is empty (it has no tokens)", param=param, code="empty")
        return _token_ids(ids, param, vocab)
    if isinstance(value, list):
        return _token_ids(value, param, vocab)
    raise ApiError(400, f"'{param}' must be a string or a list of token ids", param=param, code="invalid_type")


def _check_prompt(segments: list[list[int]], limits: Limits, param: str) -> int:
    total = sum(map(len, segments))
    if total > limits.max_prompt_tokens:
        raise ApiError(400, f"the prompt has {total} tokens, over the server's limit of {limits.max_prompt_tokens}",
                       param=param, code="context_length_exceeded")
    if len(segments) > limits.max_segments + 1:
        raise ApiError(400, f"the prompt has {len(segments) - 1} segments before its query, over the server's limit "
                       f"of {limits.max_segments}", param=param, code="too_many_segments")
    return total


def _constraints(body: dict) -> None:
    """Refuse what asks for output the server cannot constrain (JSON mode, tool calls): answered as free text, a
    client would take it for what it asked."""
    response_format = _get(body, "response_format", "dict", {})
    kind = response_format.get("type", "text")
    if kind != "text":
        raise ApiError(400, f"'response_format' of type {kind!r:.40} is not supported (only 'text': the output is "
                       "not constrained)", param="response_format", code="unsupported")
    for name in ("tools", "functions"):
        if _get(body, name, "list", []):
            raise ApiError(400, f"'{name}' is not supported (no tool calling)", param=name, code="unsupported")
    for name in ("tool_choice", "function_call"):
        choice = body.get(name)
        if choice not in (None, "none", "auto"):
            raise ApiError(400, f"'{name}' {choice!r:.60} is not supported (no tool calling)", param=name,
                           code="unsupported")


def _common(body: dict, segments, total: int, limits: Limits, tokenizer, *, chat: bool) -> Parsed:
    if _get(body, "n", "int", 1) != 1:
        raise ApiError(400, "'n' must be 1 (one choice per request)", param="n", code="unsupported")
    if _get(body, "best_of", "int", 1) != 1:
        raise ApiError(400, "'best_of' must be 1", param="best_of", code="unsupported")
    for name in ("presence_penalty", "frequency_penalty"):
        if _get(body, name, "number", 0) != 0:
            raise ApiError(400, f"'{name}' is not supported (must be 0)", param=name, code="unsupported")
    if _get(body, "logit_bias", "dict", {}):
        raise ApiError(400, "'logit_bias' is not supported", param="logit_bias", code="unsupported")
    if not chat and (_get(body, "echo", "bool", False) or _get(body, "suffix", "str", "")):
        param = "echo" if body.get("echo") else "suffix"
        raise ApiError(400, f"'{param}' is not supported", param=param, code="unsupported")
    _constraints(body)
    room = limits.max_keys - total
    name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    default = min(limits.max_new_tokens, room) if chat else min(16, limits.max_new_tokens, room)
    max_tokens = _get(body, name, "int", default)
    if max_tokens < 0:
        raise ApiError(400, f"'{name}' must be >= 0, got {max_tokens}", param=name, code="invalid_value")
    if max_tokens > limits.max_new_tokens:
        raise ApiError(400, f"'{name}' is {max_tokens}, over the server's limit of {limits.max_new_tokens} new "
                       "tokens", param=name, code="invalid_value")
    if max_tokens > room:
        raise ApiError(400, f"the prompt ({total} tokens) + '{name}' ({max_tokens}) exceeds the context of "
                       f"{limits.max_keys} tokens", param=name, code="context_length_exceeded")
    temperature = float(_get(body, "temperature", "number", 1.0))
    if temperature < 0:
        raise ApiError(400, f"'temperature' must be >= 0, got {temperature}", param="temperature",
                       code="invalid_value")
    top_p = float(_get(body, "top_p", "number", 1.0))
    if not 0 < top_p <= 1:
        raise ApiError(400, f"'top_p' must lie in (0, 1], got {top_p}", param="top_p", code="invalid_value")
    top_k = _get(body, "top_k", "int", 0)
    if top_k < -1:
        raise ApiError(400, f"'top_k' must be -1 or 0 (off) or >= 1, got {top_k}", param="top_k", code="invalid_value")
    top_k = min(top_k, limits.vocab_size)  # above the vocabulary it keeps every token, and it must fit an int32
    seed = _get(body, "seed", "int")
    if seed is not None and not -(1 << 63) <= seed < (1 << 64):
        raise ApiError(400, "'seed' must fit in 64 bits", param="seed", code="invalid_value")
    stop = body.get("stop")
    stop = [] if stop is None else ([stop] if isinstance(stop, str) else stop)
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise ApiError(400, "'stop' must be a string or a list of strings", param="stop", code="invalid_type")
    if any(stop) and tokenizer is None:
        raise ApiError(400, "'stop' strings need a tokenizer; the served model has none (use 'stop_token_ids')",
                       param="stop", code="no_tokenizer")
    stop_ids = _get(body, "stop_token_ids", "list", [])
    stop_ids = _token_ids(stop_ids, "stop_token_ids", limits.vocab_size) if stop_ids else []
    if chat:
        top = _get(body, "top_logprobs", "int")
        logprobs = (top or 0) if _get(body, "logprobs", "bool", False) else None
        if top is not None and logprobs is None:
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs", code="invalid_value")
        lp_param = "top_logprobs"
    else:
        logprobs, lp_param = _get(body, "logprobs", "int"), "logprobs"
    if logprobs is not None and not 0 <= logprobs <= limits.top_logprobs:
        raise ApiError(400, f"'{lp_param}' must lie in [0, {limits.top_logprobs}], got {logprobs}", param=lp_param,
                       code="invalid_value")
    stream = _get(body, "stream", "bool", False)
    options = _get(body, "stream_options", "dict", {})
    if body.get("stream_options") is not None and not stream:  # as OpenAI: options of a stream that is not one
        raise ApiError(400, "'stream_options' is only allowed with 'stream': true", param="stream_options",
                       code="invalid_value")
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise ApiError(400, "'stream_options.include_usage' must be a boolean", param="stream_options",
                       code="invalid_type")
    mode = _get(body, "pic_mode", "str")
    if mode is not None and mode not in MODES:
        raise ApiError(400, f"unknown 'pic_mode' {mode!r}; choose one of {', '.join(MODES)}", param="pic_mode",
                       code="invalid_value")
    seam = body.get("seam")
    if isinstance(seam, list):  # one knob per document (every segment but the query)
        if not all(_is_number(knob) for knob in seam):
            raise ApiError(400, "'seam' must be a number or an array of numbers, one per document", param="seam",
                           code="invalid_type")
        try:
            segment_seams(seam, [len(s) for s in segments[:-1]])
        except ValueError as error:
            raise ApiError(400, f"bad 'seam': {error}", param="seam", code="invalid_value") from None
        seam = tuple(seam)
    else:
        seam = _get(body, "seam", "number")
    if seam is not None and not isinstance(seam, tuple):
        try:
            seam_tokens(seam, 1)
        except ValueError as error:
            raise ApiError(400, f"bad 'seam': {error}", param="seam", code="invalid_value") from None
    salt = _get(body, "cache_salt", "str")
    if salt is not None:
        _unicode(salt, "cache_salt")
    timeout = _get(body, "timeout", "number")
    if timeout is not None and timeout <= 0:
        raise ApiError(400, "'timeout' must be > 0 seconds", param="timeout", code="invalid_value")
    stop_ids = set(stop_ids)
    if not _get(body, "ignore_eos", "bool", False):
        stop_ids |= set(limits.eos_ids)
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=max(top_k, 0),
                            seed=None if seed is None else seed % (1 << 64), stop=tuple(s for s in stop if s),
                            stop_token_ids=frozenset(stop_ids), logprobs=logprobs)
    return Parsed(segments=segments, params=params, stream=stream, include_usage=include_usage, mode=mode, seam=seam,
                  cache_salt=salt, return_token_ids=_get(body, "return_token_ids", "bool", False) or tokenizer is None,
                  timeout=timeout)


def check_model(body: dict, names: tuple[str, ...]) -> None:
    model = _get(body, "model", "str")
    if model is not None and model not in names:
        raise ApiError(404, f"the model {model!r} does not exist; this server serves {names[0]!r}", param="model",
                       code="model_not_found")


# Completions ----------------------------------------------------------------------------------------------------
def parse_completion(body: dict, limits: Limits, tokenizer, separator: str) -> Parsed:
    vocab = limits.vocab_size
    segments_field = _get(body, "segments", "list")
    prompt = body.get("prompt")
    if _get(body, "documents", "list"):  # the chat extension: here it would be dropped without a word
        raise ApiError(400, "'documents' is an extension of /v1/chat/completions; in completions give the documents "
                       "as 'segments' or in 'prompt' split on the separator", param="documents", code="unsupported")
    if segments_field is not None:
        if prompt not in (None, "", []):
            raise ApiError(400, "give 'prompt' or 'segments', not both", param="segments", code="invalid_value")
        if not segments_field:
            raise ApiError(400, "'segments' is empty", param="segments", code="empty")
        segments = [_segment(s, f"segments[{i}]", tokenizer, vocab) for i, s in enumerate(segments_field)]
        param = "segments"
    else:
        if prompt is None:
            raise ApiError(400, "'prompt' is required (or the 'segments' extension)", param="prompt",
                           code="missing_field")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one prompt
        if isinstance(prompt, str):
            if not prompt:
                raise ApiError(400, "'prompt' is empty", param="prompt", code="empty")
            pieces = prompt.split(separator)
            segments = []
            for i, piece in enumerate(pieces):
                ids = _encode(piece, tokenizer, "prompt")
                if not ids:
                    where = f"segment {i} of {len(pieces)} (split on {separator!r})" if len(pieces) > 1 else "it"
                    raise ApiError(400, f"'prompt' is empty: {where} has no tokens", param="prompt", code="empty")
                segments.append(_token_ids(ids, "prompt", vocab))
        elif isinstance(prompt, list) and all(_is_int(t) or isinstance(t, float) for t in prompt):
            segments = [_token_ids(prompt, "prompt", vocab)]
        elif isinstance(prompt, list) and all(isinstance(p, (str, list)) for p in prompt):
            raise ApiError(400, "'prompt' must be one prompt (a string or a list of token ids); several prompts per "
                           "request are not supported", param="prompt", code="unsupported")
        elif isinstance(prompt, list):
            i = next(i for i, t in enumerate(prompt) if not (_is_int(t) or isinstance(t, float)))
            raise ApiError(400, f"'prompt' must be one string or a list of integers (token ids), but prompt[{i}] is "
                           f"{type(prompt[i]).__name__} {prompt[i]!r:.40}", param="prompt", code="invalid_type")
        else:
            raise ApiError(400, f"'prompt' must be a string or a list of token ids, got {type(prompt).__name__}",
                           param="prompt", code="invalid_type")
        param = "prompt"
    total = _check_prompt(segments, limits, param)
    return _common(body, segments, total, limits, tokenizer, chat=False)


# Chat -----------------------------------------------------------------------------------------------------------
def _content(message: dict, i: int) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise ApiError(400, f"'messages[{i}].content[{j}]' must be a text part "
                               "({\"type\": \"text\", \"text\": ...})", param=f"messages[{i}].content",
                               code="unsupported")
            parts.append(part["text"])
        return "".join(parts)
    raise ApiError(400, f"'messages[{i}].content' must be a string or a list of text parts",
                   param=f"messages[{i}].content", code="invalid_type")


def chat_messages(body: dict) -> list[dict]:
    """The conversation as [{"role", "content"}], documents inserted after the leading system messages."""
    messages = body.get("messages")
    if messages is None:
        raise ApiError(400, "'messages' is required", param="messages", code="missing_field")
    if not isinstance(messages, list):
        raise ApiError(400, "'messages' must be an array", param="messages", code="invalid_type")
    if not messages:
        raise ApiError(400, "'messages' is empty", param="messages", code="empty")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ApiError(400, f"'messages[{i}]' must be an object", param=f"messages[{i}]", code="invalid_type")
        role = m.get("role")
        if role not in ROLES:
            raise ApiError(400, f"'messages[{i}].role' must be one of {', '.join(ROLES)}, got {role!r:.40}",
                           param=f"messages[{i}].role", code="invalid_value")
        out.append(dict(role=role, content=_content(m, i)))
    documents = _get(body, "documents", "list", [])
    for j, d in enumerate(documents):
        if not isinstance(d, str) or not d:
            raise ApiError(400, f"'documents[{j}]' must be a non-empty string", param=f"documents[{j}]",
                           code="invalid_type")
    lead = next((i for i, m in enumerate(out) if m["role"] not in ("system", "developer")), len(out))
    if lead == len(out):
        raise ApiError(400, "'messages' holds only system messages; the last message is the query", param="messages",
                       code="invalid_value")
    return out[:lead] + [dict(role="user", content=d) for d in documents] + out[lead:]


class ChatRenderer:
    """Conversation -> one text per segment, with a Jinja chat template (as in a tokenizer_config.json) or the plain
    "role: content" form."""

    def __init__(self, template: str | None = None, special: dict | None = None):
        self.template, self.special = None, dict(special or {})
        if template:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

            def raise_exception(message):
                raise ApiError(400, f"the chat template rejected the conversation: {message}", param="messages",
                               code="invalid_value")

            env.globals["raise_exception"] = raise_exception
            self.template = env.from_string(template)

    def whole(self, messages: list[dict]) -> str:
        """The whole conversation's rendering with the generation prompt, in one render (`render` takes one per
        message): what the segments add up to, to refuse a conversation too long before splitting it. Only with
        a template: without one the split renders each message once."""
        return self.template.render(messages=messages, add_generation_prompt=True, **self.special)

    def render(self, messages: list[dict]) -> list[str]:
        if self.template is None:
            texts = [f"{m['role']}: {m['content']}\n" for m in messages]
            texts[-1] += "assistant:"
            return texts
        texts, before = [], ""
        for i in range(len(messages)):
            last = i == len(messages) - 1
            now = self.template.render(messages=messages[:i + 1], add_generation_prompt=last, **self.special)
            if not now.startswith(before):  # the template rewrites earlier turns: no per-message split exists
                return [self.template.render(messages=messages, add_generation_prompt=True, **self.special)]
            texts.append(now[len(before):])
            before = now
        if any(not t for t in texts):  # a message the template renders as nothing: fold it into the next one
            merged, carry = [], ""
            for t in texts:
                carry += t
                if carry:
                    merged.append(carry)
                    carry = ""
            texts = merged
        return texts


def parse_chat(body: dict, limits: Limits, tokenizer, renderer: ChatRenderer) -> Parsed:
    messages = chat_messages(body)
    if tokenizer is None:
        raise ApiError(400, "chat needs a tokenizer, and the served model has none: use /v1/completions with token "
                       "ids", param="messages", code="no_tokenizer")
    if renderer.template is not None:
        # the per-message split renders every prefix of the conversation, so its cost grows with the square of
        # the messages: a conversation too long for the prompt is refused after one render instead
        if len(messages) > limits.max_prompt_tokens:
            raise ApiError(400, f"'messages' holds {len(messages)} messages (documents included), more than the "
                           f"server's limit of {limits.max_prompt_tokens} prompt tokens", param="messages",
                           code="context_length_exceeded")
        total = len(_encode(renderer.whole(messages), tokenizer, "messages"))
        if total > limits.max_prompt_tokens:
            raise ApiError(400, f"the prompt has {total} tokens, over the server's limit of "
                           f"{limits.max_prompt_tokens}", param="messages", code="context_length_exceeded")
    segments = []
    for i, text in enumerate(renderer.render(messages)):
        ids = _encode(text, tokenizer, "messages")
        if ids:
            segments.append(_token_ids(ids, "messages", limits.vocab_size))
    if not segments:
        raise ApiError(400, "'messages' renders to no tokens", param="messages", code="empty")
    total = _check_prompt(segments, limits, "messages")
    return _common(body, segments, total, limits, tokenizer, chat=True)


# Log-probabilities ----------------------------------------------------------------------------------------------
class TokenTexts:
    """Each generated token's text as it reads in the completion, and where it starts there: what the token adds
    to the decoding of the few tokens before it, so the tokens add up to the text (decoded alone, a token loses the
    leading space a Metaspace tokenizer gives it, and every offset after it drifts). The alternatives' texts are
    taken in the same context. One per request, fed its tokens in order (streamed or not: the same texts)."""

    CONTEXT = 4  # tokens decoded before it (a word marker's space needs one); a context ending in part of a
    # character does not prefix the longer decoding, and the token is then decoded alone

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.offset = tokenizer, [], 0

    def __call__(self, token: int, alternatives) -> tuple[str, int, list[str]]:
        """(the token's text, its offset in the completion's text, the alternatives' texts); then the next token."""
        if self.tokenizer is None:
            texts = [f"token_id:{t}" for t in (token, *alternatives)]
        else:
            context = self.ids[-self.CONTEXT:]
            before = self.tokenizer.decode(context)

            def text(t: int) -> str:
                after = self.tokenizer.decode(context + [t])
                return after[len(before):] if after.startswith(before) else self.tokenizer.decode([t])

            texts = [text(t) for t in (token, *alternatives)]
        offset = self.offset
        self.ids.append(token)
        self.offset += len(texts[0])
        return texts[0], offset, texts[1:]


def completion_logprobs(entries: list[tuple], texts: TokenTexts) -> dict[str, Any]:
    """OpenAI's completions block from [(token, logprob, [(id, logprob), ...]), ...]."""
    out = dict(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    for token, lp, top in entries:
        text, offset, others = texts(token, [t for t, _ in top])
        out["tokens"].append(text)
        out["token_logprobs"].append(lp)
        out["top_logprobs"].append({other: v for other, (_, v) in zip(others, top)})
        out["text_offset"].append(offset)
    return out


def chat_logprobs(entries: list[tuple], texts: TokenTexts) -> dict[str, Any]:
    def item(text, lp):
        return dict(token=text, logprob=lp, bytes=list(text.encode()))

    content = []
    for token, lp, top in entries:
        text, _, others = texts(token, [t for t, _ in top])
        content.append(dict(item(text, lp), top_logprobs=[item(other, v) for other, (_, v) in zip(others, top)]))
    return dict(content=content)
