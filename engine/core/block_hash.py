"""The prefix cache's block hashes: vLLM's sha256_cbor scheme (vllm/v1/core/kv_cache_utils.py hash_block_tokens,
prefix_caching_hash_algo "sha256_cbor"), so a router rebuilds them from token ids as it does for vLLM (llm-d's
HashAlgorithm sha256_cbor; docs/serving.md):

    none_hash     = sha256(cbor(hash_seed))           hash_seed: PYTHONHASHSEED's text, as vLLM's ("" when unset)
    digest(block) = sha256(cbor([parent digest, [token ids], extra keys]))   parent of block 0: none_hash
    key(block)    = the digest's last 8 bytes, big-endian   what KV-cache events carry (vLLM's int hashes)

cbor() is canonical CBOR (cbor2.dumps(..., canonical=True) gives the same bytes).

Extra keys are None for the base model; a sequence with a seed (a LoRA adapter, the LongRoPE switch:
engine/core/sequence.py hash_seed) has its seed as every block's extra keys (vLLM puts the adapter's name
there; pagoda's seed also has the adapter's load number, so a reloaded adapter never hits its old blocks).
A block's hash in the block manager is the whole digest as an int. Python's hash() is not reproducible: None's
hash is its address before Python 3.12, and str hashes are salted per process.
"""
import hashlib
import struct

PREFIX_HASH_ALGO = "sha256_cbor"  # vllm:cache_config_info's prefix_caching_hash_algo
KEY_MASK = (1 << 64) - 1  # a digest's last 8 bytes: key(block) = digest & KEY_MASK
_HEADS = (struct.Struct(">B"), struct.Struct(">H"), struct.Struct(">I"), struct.Struct(">Q"))


def none_hash(hash_seed: str) -> int:
    return int.from_bytes(hashlib.sha256(cbor(hash_seed)).digest(), "big")


def block_hash(parent: int, token_ids, extra=None) -> int:
    out = bytearray(b"\x83\x58\x20")  # an array of 3; 32 bytes
    out += parent.to_bytes(32, "big")
    _head(4, len(token_ids), out)
    for t in token_ids:  # cbor(), inlined for the common case: token ids are small non-negative ints
        if t < 24:
            out.append(t)
        else:
            _head(0, t, out)
    _encode(extra, out)
    return int.from_bytes(hashlib.sha256(out).digest(), "big")


def cbor(value) -> bytes:
    """Canonical CBOR (RFC 8949 4.2.1) of ints, str, bytes, None, bools, and lists or tuples of them."""
    out = bytearray()
    _encode(value, out)
    return bytes(out)


def _encode(value, out: bytearray) -> None:
    if isinstance(value, bool):
        out.append(0xF5 if value else 0xF4)
    elif isinstance(value, int):
        _head(0, value, out) if value >= 0 else _head(1, -1 - value, out)
    elif isinstance(value, (list, tuple)):
        _head(4, len(value), out)
        for v in value:
            _encode(v, out)
    elif isinstance(value, bytes):
        _head(2, len(value), out)
        out += value
    elif isinstance(value, str):
        data = value.encode()
        _head(3, len(data), out)
        out += data
    elif value is None:
        out.append(0xF6)
    else:
        raise TypeError(f"cannot hash a {type(value).__name__} into a block hash")


def _head(major: int, n: int, out: bytearray) -> None:
    if n < 24:
        out.append(major << 5 | n)
        return
    size = 0 if n < 1 << 8 else 1 if n < 1 << 16 else 2 if n < 1 << 32 else 3
    out.append(major << 5 | 24 + size)
    out += _HEADS[size].pack(n)
