"""Prefix-cache block hashing: the one function engines and the scheduler share.

pdserve uses vLLM's `sha256_cbor` chain, so hashes agree with vLLM and with consumers of its
KV events (llm-d's indexer, Dynamo's router):

    hash_i = sha256(cbor2.dumps((parent, tuple(tokens_i), extra_keys_i), canonical=True))

where `parent` is hash_{i-1}, or NONE_HASH = sha256(cbor(seed string)) for the first block, and
`extra_keys_i` is a tuple or None. Only full blocks are hashed. On the wire a hash is its low
64 bits as an unsigned integer (vLLM's default `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`).

Every process of a cluster must use the same algorithm and seed; the compatibility hash at
registration includes both, so a mismatch is refused instead of silently never matching.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import cbor2

HASH_ALGORITHM = "sha256_cbor"
DEFAULT_HASH_SEED = "0"

BlockHash = bytes
ExtraKeys = tuple[Any, ...] | None


def _sha256_cbor(obj: Any) -> bytes:
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


@functools.lru_cache(maxsize=64)
def none_hash(seed: str = DEFAULT_HASH_SEED) -> BlockHash:
    """The parent hash of a sequence's first block, derived from the configured seed (computed
    once per seed: every hashed prompt starts from it)."""
    return _sha256_cbor(seed)


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra_keys: ExtraKeys,
               seed: str = DEFAULT_HASH_SEED) -> BlockHash:
    """Hash of one full block chained to its parent (None or b"" for the first block)."""
    return _sha256_cbor((parent or none_hash(seed), tuple(token_ids), extra_keys))


def to_external(block_hash: BlockHash) -> int:
    """64-bit form used in KV events: the digest's low 64 bits, unsigned."""
    return int.from_bytes(block_hash[-8:], "big")


@dataclass(frozen=True, slots=True)
class BlockHasher:
    """Hashes token sequences into chained block hashes with a fixed block size and seed.

    Callers may rely on: `hash_blocks(tokens)[i]` depends only on tokens[: (i+1)*block_size],
    the extra keys, and the seed; a trailing partial block is never hashed.
    """

    block_size: int
    seed: str = DEFAULT_HASH_SEED

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")

    @property
    def root(self) -> BlockHash:
        return none_hash(self.seed)

    def hash_blocks(self, token_ids: Sequence[int], parent: BlockHash | None = None,
                    extra_keys: ExtraKeys = None, start_block: int = 0) -> list[BlockHash]:
        """Chained hashes of every full block of token_ids from block `start_block` on.

        `parent` is the hash of block start_block-1 (None when start_block is 0); extra keys
        apply to every hashed block.
        """
        hashes: list[BlockHash] = []
        prev = parent or self.root
        n_full = len(token_ids) // self.block_size
        for i in range(start_block, n_full):
            block = token_ids[i * self.block_size:(i + 1) * self.block_size]
            prev = _sha256_cbor((prev, tuple(block), extra_keys))
            hashes.append(prev)
        return hashes

    def external_hashes(self, token_ids: Sequence[int], extra_keys: ExtraKeys = None) -> list[int]:
        return [to_external(h) for h in self.hash_blocks(token_ids, extra_keys=extra_keys)]
