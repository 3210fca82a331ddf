"""Engine emulator: a real HTTP server speaking vLLM's OpenAI API and metrics,
driven in real time by the simulator's engine model (see docs/emulator.md)."""

from __future__ import annotations

from tokenfleet.emulator.server import EmulatorConfig, EmulatorServer
from tokenfleet.tokenizer import chat_block_hashes, prompt_block_hashes

__all__ = ["EmulatorConfig", "EmulatorServer", "chat_block_hashes", "prompt_block_hashes"]
