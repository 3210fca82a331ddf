"""A served model's own tokenizer and chat template, hashed as vLLM V1 hashes blocks.

The byte tokenizer of :mod:`tokenfleet.tokenizer` matches the engine
emulator. A real vLLM counts tokens with the model's tokenizer and names its
prefix-cache blocks by hashes of those token ids; for TokenPilot's exact
cache tier the block hashes the router computes from a request must be the
very ones vLLM publishes in its KV events. This module reproduces vLLM's
chain (vLLM 0.32, ``vllm/v1/core/kv_cache_utils.py``):

* the prompt is the model's chat template rendered with
  ``add_generation_prompt=True`` and tokenized without adding special tokens
  (``ChatCompletionRequest.add_special_tokens`` defaults to False: the
  template writes the BOS token itself);
* ``hash_block_tokens``: block ``k`` hashes ``(parent, tuple(token_ids),
  extra_keys)`` with ``sha256`` of its pickle (``vllm/utils/hashing.py``, the
  default ``--prefix-caching-hash-algo``); the first block's parent is
  ``NONE_HASH = sha256(PYTHONHASHSEED or "vllm-none-hash")``;
  ``extra_keys`` is None for a plain text prompt (no LoRA, images, cache salt);
* KV events carry ``int.from_bytes(hash, "big") & (2**64 - 1)``
  (``maybe_convert_block_hash``, ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``).

Only full blocks are hashed, with the engine's block size (``--block-size``:
16 by default on GPUs; vLLM's CPU attention needs a multiple of 32). Bigger
engine blocks are split into TokenFleet's 16-token router blocks the same way
the worker splits them in the engine's KV events
(:func:`tokenfleet.tokenizer.split_engine_blocks`).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenfleet.core.types import BLOCK_SIZE_TOKENS
from tokenfleet.tokenizer import ChatPrompt, split_engine_blocks

#: vLLM's seed for the first block's parent when PYTHONHASHSEED is unset
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
_MASK64 = (1 << 64) - 1


def _sha256_pickle(obj: object) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def none_hash(seed: str | None = None) -> bytes:
    """The parent hash of a prompt's first block, as the engine derives it."""
    if seed is None:
        seed = os.environ.get("PYTHONHASHSEED") or DEFAULT_NONE_HASH_SEED
    return _sha256_pickle(seed)


def vllm_block_hashes(
    token_ids: Sequence[int],
    block_size_tokens: int = BLOCK_SIZE_TOKENS,
    seed: str | None = None,
) -> tuple[int, ...]:
    """The 64-bit block hashes vLLM's KV events report for these prompt tokens."""
    parent = none_hash(seed)
    out: list[int] = []
    full = len(token_ids) // block_size_tokens
    for j in range(full):
        block = tuple(token_ids[j * block_size_tokens : (j + 1) * block_size_tokens])
        parent = _sha256_pickle((parent, block, None))
        out.append(int.from_bytes(parent, "big") & _MASK64)
    return tuple(out)


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", "lstrip": false, ...}
        value = value.get("content")
    return value if isinstance(value, str) else None


class HFChatTokenizer:
    """Tokenize chat requests exactly as a vLLM serving ``model_dir`` does."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        block_size_tokens: int = BLOCK_SIZE_TOKENS,
        hash_seed: str | None = None,
    ) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError:  # pragma: no cover - depends on the install
            raise ImportError(
                "a model tokenizer needs the 'tokenizers' package: pip install 'tokenfleet[vllm]'"
            ) from None
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        root = Path(model_dir)
        tok_file = root / "tokenizer.json"
        cfg_file = root / "tokenizer_config.json"
        if not tok_file.is_file():
            raise FileNotFoundError(
                f"{tok_file} not found: point the tokenizer at the model directory vLLM serves"
            )
        self.model_dir = root
        self._tok = Tokenizer.from_file(str(tok_file))
        cfg: dict[str, Any] = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        template = cfg.get("chat_template")
        jinja_file = root / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text()
        if isinstance(template, list):  # named templates: vLLM uses "default"
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if not isinstance(template, str):
            raise ValueError(f"{root} has no chat template (tokenizer_config.json chat_template)")
        # as transformers renders chat templates (and vLLM through it)
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(
            x, ensure_ascii=False, indent=indent
        )
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self._template = env.from_string(template)
        self._special = {
            name: text
            for name in ("bos_token", "eos_token", "unk_token", "pad_token")
            if (text := _token_text(cfg.get(name))) is not None
        }
        self.block_size_tokens = block_size_tokens
        self._none_hash_seed = hash_seed

    def render(self, messages: Sequence[Any]) -> str:
        """The prompt text the engine sees (``ValueError``: bad messages)."""
        msgs = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ValueError(f"messages[{i}] must be an object with a string 'role'")
            msgs.append(m)
        try:
            return str(
                self._template.render(messages=msgs, add_generation_prompt=True, **self._special)
            )
        except _TemplateError as exc:
            raise ValueError(str(exc)) from None

    def token_ids(self, messages: Sequence[Any]) -> list[int]:
        return list(self._tok.encode(self.render(messages), add_special_tokens=False).ids)

    def tokenize_chat(self, messages: Sequence[Any]) -> ChatPrompt:
        """Render, count and hash in one pass, like :func:`tokenfleet.tokenizer.tokenize_chat`."""
        text = self.render(messages)
        return self.tokenize_ids(self._tok.encode(text, add_special_tokens=False).ids, text)

    def tokenize_text(self, text: str) -> ChatPrompt:
        """A ``/v1/completions`` prompt: the text as sent, with the tokenizer's
        special tokens (vLLM's ``CompletionRequest.add_special_tokens`` is True)."""
        ids = self._tok.encode(text, add_special_tokens=True).ids
        return self.tokenize_ids(ids, text)

    def tokenize_ids(self, ids: Sequence[int], text: str = "") -> ChatPrompt:
        """A prompt given as token ids: vLLM hashes them as they are."""
        size = self.block_size_tokens
        hashes = vllm_block_hashes(ids, size, self._none_hash_seed)
        return ChatPrompt(text, len(ids), split_engine_blocks(hashes, size))


class _TemplateError(Exception):
    """A chat template's ``raise_exception`` (bad roles, alternation, ...)."""


def _raise(message: str) -> None:
    raise _TemplateError(message)
