"""Chained prompt-block hashes at the engine block size (16 tokens).

A block's hash covers the whole prefix up to and including it, exactly like
vLLM's automatic prefix caching (``vllm/v1/core/kv_cache_utils.py``,
``hash_block_tokens``: the parent block's hash, the block's token ids and any
extra keys). So two prompts share the hash of block ``j`` iff they share all
tokens of blocks ``0..j``, and only *full* blocks get a hash.

Traces do not carry token ids, so the simulator hashes token *identities*
instead: a token is ``(content_id, offset)``, where ``content_id`` names a
piece of text (a system prompt, a document, a Mooncake 512-token block).
Hashes use CPython's ``hash`` on tuples of ints, which is deterministic across
processes (``PYTHONHASHSEED`` only salts str/bytes) and fast. Strings are
turned into ints with :func:`content_id` (blake2b) first, never hashed raw.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

from tokenfleet.core.types import BLOCK_SIZE_TOKENS

BLOCK = BLOCK_SIZE_TOKENS

#: Chain roots, one per source, so hashes from unrelated sources never meet.
ROOT_TOKENS = 0x7F4A7C15
ROOT_BLOCK_IDS = 0x5DEECE66
ROOT_UNIQUE = 0x2545F491
ROOT_SEGMENTS = 0x9E3779B9


def content_id(*parts: int | str) -> int:
    """A stable 63-bit id for a tuple of ints/strings (process-independent)."""
    h = hashlib.blake2b(digest_size=8)
    for p in parts:
        if isinstance(p, int):
            h.update(b"i" + str(p).encode())
        else:
            h.update(b"s" + p.encode())
        h.update(b"\x00")
    return int.from_bytes(h.digest(), "little") >> 1


def hash_token_ids(token_ids: Sequence[int], root: int = ROOT_TOKENS) -> tuple[int, ...]:
    """Chained hashes of the full 16-token blocks of a real prompt.

    What a live router computes from a tokenized prompt.
    """
    out: list[int] = []
    prev = root
    for start in range(0, len(token_ids) - BLOCK + 1, BLOCK):
        prev = hash((prev, tuple(token_ids[start : start + BLOCK])))
        out.append(prev)
    return tuple(out)


def unique_hashes(key: int, input_tokens: int, root: int = ROOT_UNIQUE) -> tuple[int, ...]:
    """Hashes that no other ``key`` shares: for traces without prefix data."""
    n = input_tokens // BLOCK
    prev = hash((root, key))
    out = [0] * n
    for j in range(n):
        prev = hash((prev, j))
        out[j] = prev
    return tuple(out)


class BlockIdHasher:
    """Maps coarse trace block ids (e.g. Mooncake's 512-token ``hash_ids``) to
    chained 16-token engine hashes.

    Engine block ``j`` lies in trace block ``j // r`` at sub-position ``j % r``
    (``r = id_block_tokens // 16``); its hash is
    ``hash((hash of block j-1, ids[j // r], j % r))``. Two requests sharing
    their first ``k`` ids therefore share exactly their first ``k * r`` engine
    hashes. Runs of ``r`` hashes are memoised on ``(previous hash, id)``, so a
    prefix shared by many requests is hashed once.
    """

    def __init__(self, id_block_tokens: int, root: int = ROOT_BLOCK_IDS) -> None:
        if id_block_tokens <= 0 or id_block_tokens % BLOCK:
            raise ValueError(
                f"id block size must be a positive multiple of {BLOCK} tokens, "
                f"got {id_block_tokens}"
            )
        self.ratio = id_block_tokens // BLOCK
        self.root = root
        self._memo: dict[tuple[int, int], tuple[int, ...]] = {}

    def hashes(self, ids: Sequence[int], input_tokens: int) -> tuple[int, ...]:
        n = input_tokens // BLOCK
        r = self.ratio
        memo = self._memo
        out: list[int] = []
        prev = self.root
        full_ids = min(len(ids), n // r)
        for k in range(full_ids):
            hid = ids[k]
            key = (prev, hid)
            run = memo.get(key)
            if run is None:
                run_l = [0] * r
                h = prev
                for sub in range(r):
                    h = hash((h, hid, sub))
                    run_l[sub] = h
                run = tuple(run_l)
                memo[key] = run
            out.extend(run)
            prev = run[-1]
        # Trailing engine blocks of a partial last id block (never memoised).
        j = full_ids * r
        while j < n and j // r < len(ids):
            prev = hash((prev, ids[j // r], j % r))
            out.append(prev)
            j += 1
        return tuple(out)


#: (content_id, n_tokens): that many tokens of one piece of content, from offset 0.
Segment = tuple[int, int]
_Piece = tuple[int, int, int]  # (content_id, start offset, n_tokens)


class SegmentHasher:
    """Hashes prompts described as a list of content segments.

    Token ``i`` of a segment is ``(content_id, i)``; a block lying inside one
    segment hashes ``(prev, content_id, offset)``, a block straddling segments
    hashes ``(prev, *pieces)``. Two prompts whose first ``m`` token identities
    agree share every full block inside those ``m`` tokens. Each segment's run
    of hashes is memoised on the chain state where it starts, so multi-turn
    chats and repeated documents are hashed once.
    """

    def __init__(self, root: int = ROOT_SEGMENTS) -> None:
        self.root = root
        self._memo: dict[
            tuple[int, tuple[_Piece, ...], int, int],
            tuple[tuple[int, ...], int, tuple[_Piece, ...]],
        ] = {}

    def hashes(self, segments: Iterable[Segment]) -> tuple[int, ...]:
        out: list[int] = []
        prev = self.root
        carry: tuple[_Piece, ...] = ()
        for cid, length in segments:
            if length <= 0:
                continue
            key = (prev, carry, cid, length)
            hit = self._memo.get(key)
            if hit is None:
                hit = self._segment(prev, carry, cid, length)
                self._memo[key] = hit
            run, prev, carry = hit
            out.extend(run)
        return tuple(out)

    @staticmethod
    def _segment(
        prev: int, carry: tuple[_Piece, ...], cid: int, length: int
    ) -> tuple[tuple[int, ...], int, tuple[_Piece, ...]]:
        run: list[int] = []
        pos = 0
        if carry:
            have = sum(p[2] for p in carry)
            take = min(BLOCK - have, length)
            carry = carry + ((cid, 0, take),)
            pos = take
            if have + take < BLOCK:
                return (), prev, carry
            prev = hash((prev,) + carry)
            run.append(prev)
            carry = ()
        while pos + BLOCK <= length:
            prev = hash((prev, cid, pos))
            run.append(prev)
            pos += BLOCK
        if pos < length:
            carry = ((cid, pos, length - pos),)
        return tuple(run), prev, carry
