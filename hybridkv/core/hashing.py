"""Chained block hashes: the key under which a computed block is cached.

`h_k = H(h_{k-1} || tokens of block k)` with the chain's root
`h_{-1} = H(domain || extra)`, where `extra` holds everything besides the
tokens that changes the KV (the tenant's `cache_salt`, an adapter id ...).
Putting `extra` into the root makes every key of the chain depend on it, so
two requests with different salts can never share a block.

The default H is SHA-256 over a canonical byte encoding (tokens as
little-endian int64): collision resistant, so a key names its whole prefix
and a hit is safe without looking at the tokens. `hash_function="builtin"`
uses Python's 64-bit tuple hash instead: faster, but anyone who can choose
prompts can make two prefixes collide, so it is only for a single trusted
tenant; with it the manager also checks a hit's stored token ids (see
`BlockHasher.verifies`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import json
import struct
import sys
import warnings
from array import array
from collections.abc import Callable, Sequence

_DOMAIN = b"hybridkv/block-hash/v1\x00"
_SWAP = sys.byteorder != "little"
_SHA256 = hashlib.sha256()
KEY_BYTES = 32  # a SHA-256 key


def token_bytes(tokens: Sequence[int]) -> bytes:
    """Canonical encoding of token ids: little-endian int64."""
    return token_bytes_of(array("q", tokens))


def token_bytes_of(arr: array) -> bytes:
    """Canonical bytes of an int64 array."""
    if _SWAP:
        arr = array("q", arr)
        arr.byteswap()
    return arr.tobytes()


def _canonical_extra(cache_salt: str | None, extra_keys: Sequence | None) -> bytes:
    return json.dumps([cache_salt, list(extra_keys or ())], sort_keys=True, default=str).encode()


def python_sha256_chain(parent: bytes, data: bytes, offset: int, block_bytes: int, count: int) -> list[bytes]:
    """The SHA-256 keys of `count` blocks of `data` from `offset`, chained
    from `parent`: one hashlib object per block."""
    keys = []
    view = memoryview(data)
    empty = _SHA256  # copying a fresh hash object skips the constructor's argument parsing
    for off in range(offset, offset + count * block_bytes, block_bytes):
        h = empty.copy()
        h.update(parent)  # (two updates: joining the parent and the block first costs more)
        h.update(view[off:off + block_bytes])
        parent = h.digest()
        keys.append(parent)
    return keys


def _libcrypto() -> ctypes.CDLL:
    """The libcrypto Python's hashlib runs on (the keys must be hashlib's),
    else the system's."""
    import _hashlib  # noqa: F401  (loads it)

    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if "/libcrypto" in path:
                    return ctypes.CDLL(path)
    except OSError:
        pass
    name = ctypes.util.find_library("crypto")
    if name is None:
        raise OSError("no libcrypto found")
    return ctypes.CDLL(name)


class NativeSHA256Chain:
    """core/hash_chain.c (built by core/native.py): a run of blocks'
    keys in one C call over libcrypto's SHA-256, about a third of the time
    per block of `python_sha256_chain`. Loading checks it against hashlib.
    Called like python_sha256_chain; returns the keys as a tuple."""

    def __init__(self, path):
        crypto = _libcrypto()
        library = ctypes.CDLL(str(path))
        library.hk_sha256_bind.argtypes = [ctypes.c_void_p] * 3
        library.hk_sha256_bind.restype = None
        library.hk_sha256_bind(*(ctypes.cast(getattr(crypto, name), ctypes.c_void_p)
                                 for name in ("SHA256_Init", "SHA256_Update", "SHA256_Final")))
        chain = library.hk_sha256_chain
        chain.argtypes = [ctypes.c_char_p, ctypes.c_char_p] + [ctypes.c_int64] * 3 + [ctypes.c_void_p]
        chain.restype = ctypes.c_int64
        self.path = path
        self._chain = chain
        self._unpackers: dict[int, Callable] = {}
        probe = (b"\x01" * KEY_BYTES, bytes(range(256)) * 3, 8, 96, 7)  # (parent, data, offset, block, count)
        if self(*probe) != tuple(python_sha256_chain(*probe)):
            raise ImportError(f"{path}: its keys differ from hashlib's")

    def __call__(self, parent: bytes, data: bytes, offset: int, block_bytes: int, count: int) -> tuple:
        if len(parent) != KEY_BYTES or offset + count * block_bytes > len(data):
            raise ValueError("hash chain: a parent key of 32 bytes and blocks inside the data expected")
        if not count:
            return ()
        # The keys land in a bytearray, passed by address. Not
        # create_string_buffer: its array type of this length lives only as
        # long as a buffer of it does (ctypes caches such types weakly), so
        # nearly every call made a new type, ~30 us, once the collector had
        # freed the last one.
        out = bytearray(KEY_BYTES * count)
        if self._chain(parent, data, offset, block_bytes, count, ctypes.addressof(ctypes.c_char.from_buffer(out))):
            raise RuntimeError("libcrypto's SHA-256 failed")
        unpack = self._unpackers.get(count)
        if unpack is None:
            unpack = struct.Struct(f"{KEY_BYTES}s" * count).unpack
            if len(self._unpackers) < 4096:
                self._unpackers[count] = unpack
        return unpack(out)


_native: list = []  # [NativeSHA256Chain or None, why not] once looked for
# Fewer blocks (a decode step's one) go the hashlib way: a call through
# ctypes costs about two blocks' hashing (~1.9 us; 4 blocks: 3.0 us in C,
# 3.4 us in Python).
_NATIVE_FROM = 4


def native_sha256_chain() -> NativeSHA256Chain | None:
    """This machine's build of hash_chain.c, loaded and checked once per
    process; None where it is not built or cannot run (then
    `native_sha256_chain_missing()` says why)."""
    if not _native:
        from .native import HASH_CHAIN

        path = HASH_CHAIN.built_library()
        if path is None:
            _native[:] = [None, "not built for this machine (`hybridkv build-kernels` builds it)"]
        else:
            try:
                _native[:] = [NativeSHA256Chain(path), None]
            except (OSError, AttributeError, ImportError) as error:
                # Built but unusable: said once, as the same keys come (slower) from hashlib.
                _native[:] = [None, f"not usable: {error}"]
                warnings.warn(f"hybridkv: the block-key chain {path.name} is {_native[1]}; hashing with hashlib",
                              RuntimeWarning, stacklevel=2)
    return _native[0]


def native_sha256_chain_missing() -> str | None:
    native_sha256_chain()
    return _native[1]


_packers: dict[int, Callable] = {}


def _packer(block_size: int) -> Callable:
    """struct's packer of `block_size` tokens as canonical bytes (token_bytes)."""
    pack = _packers.get(block_size)
    if pack is None:
        pack = _packers[block_size] = struct.Struct(f"<{block_size}q").pack
    return pack


class BlockHasher:
    """Computes chain roots and block keys for one hash function. SHA-256
    keys of runs of _NATIVE_FROM blocks or more come from hash_chain.c where
    it is built (`chain_implementation`), else from hashlib block by block:
    the same keys either way."""

    FUNCTIONS = ("sha256", "builtin")

    def __init__(self, hash_function: str | Callable[[bytes, bytes], object] = "sha256"):
        if callable(hash_function):
            # Test hook: any function (parent_key_bytes, token_bytes) -> key.
            # Treated as unsafe: hits are verified against stored tokens.
            self._custom = hash_function
            self.name = getattr(hash_function, "__name__", "custom")
            self.verifies = True
        elif hash_function in self.FUNCTIONS:
            self._custom = None
            self.name = hash_function
            self.verifies = hash_function != "sha256"
        else:
            raise ValueError(f"unknown hash_function {hash_function!r}; expected one of {self.FUNCTIONS} or a callable")
        self._plain_root = None
        native = native_sha256_chain() if self.name == "sha256" and self._custom is None else None
        self._chain = native or python_sha256_chain
        self.chain_implementation = "hash_chain.c" if native else "hashlib"

    def root(self, cache_salt: str | None = None, extra_keys: Sequence | None = None):
        if cache_salt is None and not extra_keys:
            # Most requests: no salt, no extra keys. Their root is always
            # the same; computed once (JSON and a hash cost several us).
            if self._plain_root is None:
                self._plain_root = self._root(_canonical_extra(None, None))
            return self._plain_root
        return self._root(_canonical_extra(cache_salt, extra_keys))

    def _root(self, extra: bytes):
        if self._custom is not None:
            return self._custom(_DOMAIN, extra)
        if self.name == "sha256":
            return hashlib.sha256(_DOMAIN + extra).digest()
        return hash((_DOMAIN, extra))

    def extend(self, keys: list, root, tokens: Sequence[int], block_size: int, upto: int,
               encoded: bytes | None = None) -> None:
        """Append the keys of blocks len(keys) .. upto-1 (each block's tokens
        must be known) to `keys`, chaining from the last key (or `root`).
        `encoded`: token_bytes of a prefix of `tokens`, if the caller has it."""
        start = len(keys)
        if upto <= start:
            return
        parent = keys[-1] if keys else root
        lo, hi = start * block_size, upto * block_size
        if self.name == "sha256" and self._custom is None:
            if encoded is not None and len(encoded) >= 8 * hi:
                data, offset = encoded, 8 * lo
            elif upto - start < _NATIVE_FROM:
                # A decode step's block: packed by one struct call (the same
                # little-endian int64 bytes as token_bytes, in half the time).
                pack = _packer(block_size)
                empty = _SHA256
                for pos in range(lo, hi, block_size):
                    h = empty.copy()
                    h.update(parent)
                    h.update(pack(*tokens[pos:pos + block_size]))
                    parent = h.digest()
                    keys.append(parent)
                return
            else:
                data, offset = token_bytes(tokens[lo:hi]), 0
            chain = self._chain if upto - start >= _NATIVE_FROM else python_sha256_chain
            keys.extend(chain(parent, data, offset, 8 * block_size, upto - start))
        elif self._custom is None:
            for pos in range(lo, hi, block_size):
                parent = hash((parent, tuple(tokens[pos:pos + block_size])))
                keys.append(parent)
        else:
            for pos in range(lo, hi, block_size):
                parent_bytes = parent if isinstance(parent, bytes) else repr(parent).encode()
                parent = self._custom(parent_bytes, token_bytes(tokens[pos:pos + block_size]))
                keys.append(parent)


class KnownChains:
    """Recent requests' key chains, found by their first block, so that a
    prompt opening like a recent one (a chat's next turn holds the last
    turn's prompt and answer; requests share a system prompt) takes the
    keys of the blocks they have in common instead of hashing them again.
    A key depends only on the chain's root and the tokens up to its block,
    so equal token bytes under one root give equal keys: reusing them
    changes no key, only its cost (a few comparisons of bytes, where
    hashing costs about a microsecond a block).

    Bounded like checkpoints.PrefixSightings, by two generations of dicts:
    the young one takes chains until they hold `budget` bytes of tokens or
    `capacity` first blocks, then becomes the old one, whose chains are
    forgotten (a chain's keys cost about 0.6 times its token bytes more).
    A first block keeps its `per_start` most recent chains."""

    def __init__(self, block_size: int, budget: int = 16 << 20, capacity: int = 4096, per_start: int = 4):
        self.step = 8 * block_size  # bytes per block (int64 tokens)
        self.budget = budget
        self.capacity = capacity
        self.per_start = per_start
        self._young: dict = {}  # (root, first block's bytes) -> [(bytes, keys)], newest first
        self._old: dict = {}
        self._young_bytes = 0

    def seed(self, keys: list, root, data: bytes) -> None:
        """Fill the empty `keys` with the known keys of the longest recent
        chain whose tokens `data` (canonical bytes) begins with."""
        step = self.step
        start = (root, data[:step])
        chains = self._young.get(start) or self._old.get(start)
        if not chains or len(data) < step:
            return
        best, best_keys = 0, None
        for known, known_keys in chains:
            blocks = min(len(known), len(data)) // step
            blocks = min(blocks, len(known_keys))
            if blocks <= best:
                continue
            view = memoryview(known)
            agreed = 0  # leading blocks of `known` that `data` is known to hold
            if best:
                # To beat the best so far it must agree on one block more.
                # Holding the very key object the best chain holds at its
                # last block, it agrees on all of them: one request took it
                # from the other's chain after comparing their tokens (keys
                # are compared by identity, and only 32-byte digests, which
                # Python never shares between equal values by itself).
                shares = type(best_keys[best - 1]) is bytes and known_keys[best - 1] is best_keys[best - 1]
                if not shares and not data.startswith(view[:best * step]):
                    continue
                if not data.startswith(view[best * step:(best + 1) * step], best * step):
                    continue
                agreed = best + 1
            if not data.startswith(view[agreed * step:blocks * step], agreed * step):
                blocks = self._common_blocks(data, known, agreed, blocks)
            if blocks > best:
                best, best_keys = blocks, known_keys
        if best_keys is not None:
            keys.extend(best_keys[:best])

    def _common_blocks(self, data: bytes, known: bytes, lo: int, hi: int) -> int:
        """The most whole blocks (lo <= n < hi) at which data and known agree."""
        view, step = memoryview(known), self.step
        while lo < hi - 1:  # data agrees with known on lo blocks, not on hi
            mid = (lo + hi) // 2
            if data.startswith(view[lo * step:mid * step], lo * step):  # (the first lo blocks agree)
                lo = mid
            else:
                hi = mid
        return lo

    def remember(self, root, data: bytes, keys: list) -> None:
        """`keys` are the chain of `data`'s whole blocks (a prefix of them:
        the list may grow later, never change)."""
        if len(data) < self.step:
            return
        start = (root, data[:self.step])
        young = self._young
        chains = young.get(start)
        if chains is None:
            chains = young[start] = list(self._old.pop(start, ()))
        chains[:] = [(data, keys)] + [c for c in chains if c[1] is not keys][:self.per_start - 1]
        self._young_bytes += len(data)
        if len(young) >= max(1, self.capacity // 2) or self._young_bytes >= self.budget:
            self._old, self._young, self._young_bytes = young, {}, 0
