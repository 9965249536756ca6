"""The block-key chain in C (core/hash_chain.c over libcrypto's SHA-256)
gives hashlib's keys, is what the manager uses where a compiler exists, and
is refused when its keys differ."""

from __future__ import annotations

import hashlib
import random
from dataclasses import replace

import pytest

from hybridkv.core import hashing
from hybridkv.core.hashing import BlockHasher, NativeSHA256Chain, python_sha256_chain
from hybridkv.core.native import HASH_CHAIN, compiler


@pytest.fixture(scope="module")
def native():
    chain = hashing.native_sha256_chain()
    if compiler() is not None:
        # An install or the suite's start builds it wherever a compiler is:
        # missing here would hide the path every request takes.
        assert chain is not None, hashing.native_sha256_chain_missing()
    if chain is None:
        pytest.skip(f"no C compiler here: the chain is {hashing.native_sha256_chain_missing()}")
    return chain


def test_the_c_chain_gives_hashlibs_keys(native):
    rng = random.Random(5)
    for _ in range(200):
        block_bytes = 8 * rng.choice([1, 2, 16, 17, 64])
        count = rng.randrange(0, 40)
        offset = rng.randrange(0, 3) * block_bytes
        data = rng.randbytes(offset + count * block_bytes + rng.randrange(0, 9))
        parent = rng.randbytes(32)
        assert list(native(parent, data, offset, block_bytes, count)) == \
            python_sha256_chain(parent, data, offset, block_bytes, count)
    # The definition, once by hand: key = SHA-256(parent || block).
    parent, data = bytes(32), bytes(range(128))
    assert native(parent, data, 0, 64, 2)[1] == hashlib.sha256(
        hashlib.sha256(parent + data[:64]).digest() + data[64:]).digest()


def test_the_manager_hashes_through_it_and_its_keys_are_the_loops(native):
    hasher = BlockHasher()
    assert hasher.chain_implementation == "hash_chain.c"
    plain = BlockHasher()
    plain._chain = python_sha256_chain  # the loop, for the same chains
    rng = random.Random(11)
    for _ in range(50):
        tokens = [rng.randrange(1 << 31) for _ in range(rng.randrange(1, 300))]
        data = hashing.token_bytes(tokens)
        root = hasher.root(rng.choice([None, "tenant-a"]))
        blocks = len(tokens) // 16
        fast, slow = [], []
        upto = rng.randrange(0, blocks + 1)
        hasher.extend(fast, root, tokens, 16, upto, data)
        plain.extend(slow, root, tokens, 16, upto, data)
        hasher.extend(fast, root, tokens, 16, blocks)  # the rest, without the encoded bytes
        plain.extend(slow, root, tokens, 16, blocks)
        assert fast == slow and len(fast) == blocks
        parent = root  # and the definition, block by block
        for k, key in enumerate(fast):
            parent = hashlib.sha256(parent + data[128 * k:128 * (k + 1)]).digest()
            assert key == parent


def test_bad_arguments_are_refused_before_any_read(native):
    with pytest.raises(ValueError, match="32 bytes"):
        native(b"short", bytes(256), 0, 128, 1)
    with pytest.raises(ValueError, match="inside the data"):
        native(bytes(32), bytes(200), 0, 128, 2)  # the second block would run past the data


@pytest.mark.skipif(compiler() is None, reason="no C compiler on this machine")
def test_a_build_whose_keys_differ_is_refused(tmp_path, monkeypatch):
    # Mutation: the parent left out of the hash. Loading checks the chain
    # against hashlib, so such a library is never used.
    source = tmp_path / "hash_chain.c"
    text = HASH_CHAIN.source.read_text()
    mutated = text.replace("sha_update(&context, parent, KEY_BYTES) != 1 ||", "")
    assert mutated != text
    source.write_text(mutated)
    broken = replace(HASH_CHAIN, source=source, package_dir=tmp_path / "built")
    path = broken.build()
    with pytest.raises(ImportError, match="differ from hashlib"):
        NativeSHA256Chain(path)
    assert isinstance(NativeSHA256Chain(HASH_CHAIN.built_library()), NativeSHA256Chain)
    # Found as this machine's build: a warning, and the keys from hashlib.
    import hybridkv.core.native

    monkeypatch.setattr(hybridkv.core.native, "HASH_CHAIN", broken)
    monkeypatch.setattr(hashing, "_native", [])
    with pytest.warns(RuntimeWarning, match="differ from hashlib's; hashing with hashlib"):
        hasher = BlockHasher()
    assert hasher.chain_implementation == "hashlib"
    keys: list = []
    tokens = list(range(64))
    hasher.extend(keys, hasher.root(), tokens, 16, 4, hashing.token_bytes(tokens))
    assert keys == python_sha256_chain(hasher.root(), hashing.token_bytes(tokens), 0, 128, 4)
