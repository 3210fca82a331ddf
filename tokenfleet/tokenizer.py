"""Approximate prompt tokenizer and prefix-block hashing.

Shared by the live path (the API sizes a prompt and hashes its prefix blocks
once per request with :func:`tokenize_chat`; a worker publishes approximate
KV events), tenancy's quota estimates and the engine emulator, which counts
and caches prompts the same way.

There is no model vocabulary, so this is a byte tokenizer: the UTF-8
prompt is cut into 4-byte pieces and each piece, read as a little-endian
uint32 (the last one NUL-padded), is one token id. Four bytes per token is
close to the English average of BPE tokenizers (~4 characters per token), it
is exact and invertible, and, crucially for prefix caching, two prompts that
share their first ``64 * k`` bytes share their first ``k`` 16-token blocks.

Block hashes are chained like vLLM's (``vllm/v1/core/kv_cache_utils.py``,
``hash_block_tokens``): each full block's hash covers its parent's hash and
its own token ids, so equal hash at block ``k`` implies an equal prefix up to
``k``. Each block is hashed with XXH3-64 seeded with its parent's hash: stable
across processes (unlike ``hash()``), a uint64 for msgpack, and one C call per
block. The API hashes every prompt on its request path; a chain of BLAKE2b
digests took 0.25 ms for an 8k-token prompt, XXH3 0.06 ms
(docs/benchmarks.md, section 23). These hashes only ever name blocks between
our router and our emulator: a real vLLM is matched with its own hashing
(:mod:`tokenfleet.hf_tokenizer`), so a non-cryptographic hash risks a wrong
routing estimate at worst, never another tenant's KV.

A router that talks to emulators can call :func:`prompt_block_hashes` on the
same rendered prompt and get exactly the hashes the emulator caches under.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from xxhash import xxh3_64_intdigest

from tokenfleet.core.types import BLOCK_SIZE_TOKENS

BYTES_PER_TOKEN = 4
_MAX_TOKEN_ID = 0xFFFFFFFF
_MAX_HASH = 0xFFFFFFFFFFFFFFFF


def encode_text(text: str) -> bytes:
    """The prompt's token stream as bytes: UTF-8, NUL-padded to whole tokens."""
    raw = text.encode("utf-8")
    pad = -len(raw) % BYTES_PER_TOKEN
    return raw + b"\0" * pad if pad else raw


def encode_token_ids(token_ids: Iterable[int]) -> bytes:
    """Byte stream for a prompt given as token ids (``/v1/completions``)."""
    ids = list(token_ids)
    for t in ids:
        if not 0 <= t <= _MAX_TOKEN_ID:
            raise ValueError(f"token id {t} is outside 0..{_MAX_TOKEN_ID}")
    return array("I", ids).tobytes() if ids else b""


def decode_token_ids(ids: Sequence[Any]) -> str:
    """Text of token ids (``/detokenize``); ``ValueError`` for a non-id."""
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= _MAX_TOKEN_ID:
            raise ValueError(f"token id {t!r} is outside 0..{_MAX_TOKEN_ID}")
    return array("I", ids).tobytes().rstrip(b"\0").decode("utf-8", "replace")


def token_ids(stream: bytes) -> array[int]:
    """Token ids of a byte stream produced by :func:`encode_text`."""
    out = array("I")
    out.frombytes(stream)
    return out


def num_tokens(stream: bytes) -> int:
    return len(stream) // BYTES_PER_TOKEN


def approx_num_tokens(text: str) -> int:
    """Token count the emulator assigns to ``text`` (ceil(UTF-8 bytes / 4))."""
    return -(-len(text.encode("utf-8")) // BYTES_PER_TOKEN)


def block_hashes(
    stream: bytes, block_size_tokens: int = BLOCK_SIZE_TOKENS, parent: int | None = None
) -> list[int]:
    """Chained 64-bit hashes of every *full* block of the token stream."""
    step = block_size_tokens * BYTES_PER_TOKEN
    h = (parent or 0) & _MAX_HASH
    out: list[int] = []
    append = out.append
    xxh = xxh3_64_intdigest
    for j in range(0, len(stream) - step + 1, step):
        h = xxh(stream[j : j + step], h)
        append(h)
    return out


def split_engine_blocks(engine_hashes: Sequence[int], engine_block_tokens: int) -> tuple[int, ...]:
    """Router blocks (16 tokens) for an engine's bigger blocks.

    TokenFleet's routers count cache in :data:`BLOCK_SIZE_TOKENS`-token
    blocks; an engine with ``m`` times bigger blocks (vLLM's CPU backend
    needs multiples of 32) caches and evicts ``m`` of them at once. Engine
    block ``h`` becomes ``h`` followed by ``m - 1`` hashes derived from it,
    the same way for a request's blocks and for the engine's KV events, so
    both sides agree and a match counts the right number of tokens."""
    m, rest = divmod(engine_block_tokens, BLOCK_SIZE_TOKENS)
    if m <= 1 or rest:
        return tuple(engine_hashes)
    out: list[int] = []
    blake = hashlib.blake2b
    for h in engine_hashes:
        out.append(h)
        raw = (h & 0xFFFFFFFFFFFFFFFF).to_bytes(8, "little")
        for i in range(1, m):
            out.append(int.from_bytes(blake(raw + bytes((i,)), digest_size=8).digest(), "little"))
    return tuple(out)


def render_chat(messages: Sequence[Any]) -> str:
    """Flatten chat messages the way a template would: role tags + contents.

    The exact template does not matter for the emulator, only that the same
    leading messages render to the same leading bytes (so a shared system
    prompt hits the prefix cache) and that the assistant turn is opened.
    """
    parts: list[str] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise ValueError(f"messages[{i}] must be an object with 'role' and 'content'")
        role = msg.get("role")
        if not isinstance(role, str):
            raise ValueError(f"messages[{i}].role must be a string")
        parts.append(f"<|{role}|>\n{message_text(msg.get('content'), i)}\n")
    parts.append("<|assistant|>\n")
    return "".join(parts)


def message_text(content: Any, index: int = 0) -> str:
    """Text of a message ``content``: a string or a list of typed parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts: list[str] = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text":
                texts.append(str(part.get("text", "")))
            elif isinstance(part, str):
                texts.append(part)
            else:
                raise ValueError(
                    f"messages[{index}].content: only text parts are supported by the emulator"
                )
        return "".join(texts)
    raise ValueError(f"messages[{index}].content must be a string or a list of parts")


def prompt_block_hashes(text: str, block_size_tokens: int = BLOCK_SIZE_TOKENS) -> tuple[int, ...]:
    """Hashes a router should use for a prompt sent to an emulator."""
    return tuple(block_hashes(encode_text(text), block_size_tokens))


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """One chat request's prompt, tokenized once: what every step needs of it."""

    text: str
    input_tokens: int
    block_hashes: tuple[int, ...]


def tokenize_chat(
    messages: Sequence[Any], block_size_tokens: int = BLOCK_SIZE_TOKENS
) -> ChatPrompt:
    """Render, count and hash a chat prompt in one pass (``ValueError``: bad content)."""
    text = render_chat(messages)
    stream = encode_text(text)
    return ChatPrompt(
        text, len(stream) // BYTES_PER_TOKEN, tuple(block_hashes(stream, block_size_tokens))
    )


def tokenize_prompt(text: str, block_size_tokens: int = BLOCK_SIZE_TOKENS) -> ChatPrompt:
    """A raw ``/v1/completions`` prompt: no chat template, the text as sent."""
    stream = encode_text(text)
    return ChatPrompt(
        text, len(stream) // BYTES_PER_TOKEN, tuple(block_hashes(stream, block_size_tokens))
    )


def tokenize_token_ids(
    ids: Sequence[int], block_size_tokens: int = BLOCK_SIZE_TOKENS
) -> ChatPrompt:
    """A prompt given as token ids (``ValueError`` for an id out of range)."""
    stream = encode_token_ids(ids)
    return ChatPrompt("", len(ids), tuple(block_hashes(stream, block_size_tokens)))


class PromptTokenizer(Protocol):
    """How the API counts and hashes a request's prompt for one served model:
    the emulator's byte tokenizer (:data:`BYTE_TOKENIZER`) or a real model's
    (:class:`tokenfleet.hf_tokenizer.HFChatTokenizer`)."""

    def tokenize_chat(self, messages: Sequence[Any]) -> ChatPrompt: ...

    def tokenize_text(self, text: str) -> ChatPrompt: ...

    def tokenize_ids(self, ids: Sequence[int]) -> ChatPrompt: ...


class _ByteTokenizer:
    """The emulator's tokenizer as a :class:`PromptTokenizer`."""

    def tokenize_chat(self, messages: Sequence[Any]) -> ChatPrompt:
        return tokenize_chat(messages)

    def tokenize_text(self, text: str) -> ChatPrompt:
        return tokenize_prompt(text)

    def tokenize_ids(self, ids: Sequence[int]) -> ChatPrompt:
        return tokenize_token_ids(ids)


BYTE_TOKENIZER: PromptTokenizer = _ByteTokenizer()


def chat_block_hashes(
    messages: Sequence[Any], block_size_tokens: int = BLOCK_SIZE_TOKENS
) -> tuple[int, ...]:
    return prompt_block_hashes(render_chat(messages), block_size_tokens)


# Deterministic filler for generated text: one word per output token.
FILLER_WORDS = (
    "the",
    "fleet",
    "routes",
    "tokens",
    "across",
    "many",
    "engines",
    "while",
    "cache",
    "blocks",
    "stay",
    "warm",
    "and",
    "every",
    "request",
    "finds",
    "a",
    "quiet",
    "queue",
    "with",
    "enough",
    "memory",
    "to",
    "decode",
    "quickly",
    "under",
    "load",
    "so",
    "latency",
    "remains",
    "low",
    "today",
)


def filler_word(seed: int, index: int) -> str:
    """Word for output token ``index``; the first has no leading space."""
    word = FILLER_WORDS[(seed + index * 7) % len(FILLER_WORDS)]
    return word if index == 0 else " " + word
