"""Golden vectors of the block hash (vLLM sha256_cbor, seed "0"). Never skip these: a drifted
hash silently breaks prefix routing and every external consumer of the KV events."""

from connectors.hashing import BlockHasher, hash_block, none_hash, to_external

NONE_HASH_SEED0 = "4e1195df020de59e0d65a33a4279f1183e7ae4e5d980e309f8b55adff2e61c3e"


def test_none_hash_from_seed() -> None:
    assert none_hash("0").hex() == NONE_HASH_SEED0
    assert none_hash("1") != none_hash("0")


def test_first_block_and_child() -> None:
    first = hash_block(None, [1, 2, 3, 4], None)
    assert to_external(first) == 2164874634404590027
    child = hash_block(first, [5, 6, 7, 8], None)
    assert to_external(child) == 17270480062156288726


def test_sixteen_token_block() -> None:
    assert to_external(hash_block(None, list(range(16)), None)) == 12687895063098490012


def test_extra_keys_change_the_hash() -> None:
    assert to_external(hash_block(None, [1, 2, 3, 4], ("my-lora",))) == 17638755436353697673


def test_hasher_chains_only_full_blocks() -> None:
    hasher = BlockHasher(block_size=4)
    hashes = hasher.hash_blocks([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert [to_external(h) for h in hashes] == [2164874634404590027, 17270480062156288726]
    # Resuming from a parent gives the same chain as hashing from the start.
    assert hasher.hash_blocks([1, 2, 3, 4, 5, 6, 7, 8], parent=hashes[0], start_block=1) == hashes[1:]
