"""KV-cache events as a KV-aware router reads them: a pyzmq SUB subscriber decoding with msgspec Structs
written from vLLM's published definitions (vllm/distributed/kv_events.py: array_like, tagged), the
replay ROUTER for missed batches, and block hashes rebuilt from token ids by the documented scheme."""
from __future__ import annotations

import hashlib
import struct
import time

import msgspec
import pytest
import zmq

from grpc_fixtures import tiny_checkpoint
from oracle import make_adapter
from pagoda.engine import LLM, SamplingParams
from pagoda.engine.config import EngineConfig, KVEventsConfig
from pagoda.engine.core.kv_events import KVEventPublisher

pytestmark = pytest.mark.timeout(120)


# ---- the consumer's side, from vLLM's definitions ----

class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(KVEventBatch)


SEED = "42"  # PYTHONHASHSEED on the engine's side, llm-d's hashSeed on the router's


def _cbor(v) -> bytes:
    """Canonical CBOR of what block hashes hold, written apart from pagoda's (engine/core/block_hash.py)."""
    def head(major, n):
        for limit, extra, fmt in ((24, 0, ""), (1 << 8, 24, ">B"), (1 << 16, 25, ">H"), (1 << 32, 26, ">I")):
            if n < limit:
                return bytes([major * 32 + (n if not extra else extra)]) + (struct.pack(fmt, n) if fmt else b"")
        return bytes([major * 32 + 27]) + struct.pack(">Q", n)
    if v is None:
        return b"\xf6"
    if isinstance(v, int):
        return head(0, v)
    if isinstance(v, str):
        return head(3, len(v.encode())) + v.encode()
    if isinstance(v, bytes):
        return head(2, len(v)) + v
    return head(4, len(v)) + b"".join(_cbor(x) for x in v)


def router_hashes(token_ids: list[int], block_size: int = 16, extra=None) -> list[int]:
    """vLLM's sha256_cbor block keys, as llm-d's indexer (HashAlgorithm sha256_cbor) computes them from a prompt."""
    digest, out = hashlib.sha256(_cbor(SEED)).digest(), []
    for i in range(len(token_ids) // block_size):
        digest = hashlib.sha256(_cbor([digest, token_ids[i * block_size:(i + 1) * block_size], extra])).digest()
        out.append(int.from_bytes(digest[-8:], "big"))
    return out


def test_router_hashes_are_vllms():
    """Anchored on a value computed with cbor2.dumps(canonical=True) and hashlib, as vLLM's sha256_cbor does."""
    assert router_hashes(list(range(1, 17))) == [16300212363532267629]


class Subscriber:
    """A router's subscriber: live batches from the SUB socket, gaps filled from the replay socket."""

    def __init__(self, endpoint: str, replay: str, topic: str):
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.sub.connect(endpoint)
        self.replay = self.ctx.socket(zmq.DEALER)  # a ROUTER's peer: [b"", start] out, [b"", seq, payload] back
        self.replay.connect(replay)
        self.topic = topic
        self.batches: dict[int, KVEventBatch] = {}
        self.num_live = 0

    def poll(self, timeout_ms: int = 300) -> None:
        while self.sub.poll(timeout_ms):
            topic, seq, payload = self.sub.recv_multipart()
            assert topic == self.topic.encode() and len(seq) == 8
            self.batches[int.from_bytes(seq, "big")] = DECODER.decode(payload)
            self.num_live += 1
            timeout_ms = 50

    def fill_gaps(self, start: int = 0) -> list[int]:
        """Asks the replay socket for every batch from `start`; returns the sequence numbers it sent."""
        self.replay.send_multipart([b"", start.to_bytes(8, "big")])
        got = []
        while self.replay.poll(5000):
            _, seq, payload = self.replay.recv_multipart()
            seq = int.from_bytes(seq, "big", signed=True)
            if seq == -1:
                assert payload == b""
                return got
            got.append(seq)
            self.batches.setdefault(seq, DECODER.decode(payload))
        raise AssertionError("the replay socket did not finish")

    def events(self) -> list:
        assert sorted(self.batches) == list(range(len(self.batches))), "a sequence number is missing"
        return [e for _, b in sorted(self.batches.items()) for e in b.events]

    def close(self) -> None:
        self.sub.close(linger=0)
        self.replay.close(linger=0)
        self.ctx.term()


@pytest.fixture
def setup(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", SEED)
    base = tiny_checkpoint()
    adapter = make_adapter(base, str(tmp_path / "one"), seed=3)
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"ipc://{tmp_path}/kv",
              "replay_endpoint": f"ipc://{tmp_path}/replay", "topic": "kv@pod-1@tiny"}
    # 8 blocks of 16 tokens: a prompt of 120 tokens evicts whatever is cached
    llm = LLM(base, dtype="float32", device="cpu", num_kv_blocks=8, kv_events_config=config,
              lora_modules={"one": adapter})
    sub = Subscriber(config["endpoint"], config["replay_endpoint"], config["topic"])
    try:
        yield llm, sub
    finally:
        sub.close()
        llm.engine.close()


def run(llm, prompt, sub, adapter=None) -> list:
    """Generates one token; the events this published (after those seen before)."""
    before = len(sub.events()) if sub.batches else 0
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0), adapter=adapter)
    time.sleep(0.05)
    sub.poll()
    sub.fill_gaps()
    return sub.events()[before:]


def test_stored_hit_evicted_replayed(setup):
    llm, sub = setup
    time.sleep(0.2)  # the subscription reaches the publisher; the first batch (AllBlocksCleared) may be missed live
    prompt = list(range(1, 41))  # 2 full blocks and 8 tokens
    [stored] = run(llm, prompt, sub)[1:]
    assert sub.events()[0] == AllBlocksCleared()  # a (re)started replica holds nothing
    assert isinstance(stored, BlockStored) and stored.token_ids == prompt[:32] and stored.block_size == 16
    assert stored.parent_block_hash is None and stored.lora_id is None and stored.lora_name is None
    assert stored.medium == "GPU" and stored.group_idx == 0 and stored.kv_cache_spec_kind == "full_attention"
    assert stored.block_hashes == router_hashes(prompt)  # the router rebuilds them from the token ids

    assert run(llm, prompt, sub) == []  # a prefix-cache hit: nothing new stored
    assert llm.generate([prompt], SamplingParams(max_tokens=1))[0].num_cached_tokens == 32

    # the same tokens under a LoRA adapter: other blocks, seeded by the adapter, and named
    [lora] = run(llm, prompt, sub, adapter="one")
    assert lora.lora_name == "one" and lora.lora_id == 1 and lora.token_ids == prompt[:32]
    assert not set(lora.block_hashes) & set(stored.block_hashes)
    # its extra keys say how: the sequence's seed in every block (engine/core/block_hash.py)
    assert lora.extra_keys == [["lora", "one", 1]] * 2 and stored.extra_keys == [None, None]
    assert lora.block_hashes == router_hashes(prompt, extra=lora.extra_keys[0])

    long = list(range(100, 220))  # 120 tokens: 8 blocks, the whole cache
    events = run(llm, long, sub)
    removed = {h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes}
    assert removed == set(stored.block_hashes) | set(lora.block_hashes)  # eviction removes them
    assert all(e.medium == "GPU" for e in events if isinstance(e, BlockRemoved))
    [new] = [e for e in events if isinstance(e, BlockStored)]
    assert new.block_hashes == router_hashes(long)[:7] and new.parent_block_hash is None

    # a subscriber that missed everything gets every batch back from the replay socket, as sent live
    live = dict(sub.batches)
    late = Subscriber(f"{sub.sub.getsockopt(zmq.LAST_ENDPOINT).decode()}", sub.replay.getsockopt(
        zmq.LAST_ENDPOINT).decode(), sub.topic)
    try:
        assert late.fill_gaps() == list(range(len(live)))
        assert late.batches == live and sub.num_live >= len(live) - 1
        assert late.fill_gaps(3) == list(range(3, len(live)))
    finally:
        late.close()


def test_slow_subscriber_never_stalls(tmp_path):
    """A subscriber that never reads: the PUB socket drops past its high-water mark and the publisher's thread
    keeps up; a queue with no room drops the batch at once. publish() never waits."""
    record = ("stored", 0, 1, None, tuple(range(16)), None, None, 0)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)  # connected, never reading
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVHWM, 1)
    try:
        config = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"ipc://{tmp_path}/kv", hwm=1)
        publisher = KVEventPublisher(config, 16, (0,))
        sub.connect(config.endpoint)
        for _ in range(50):
            for _ in range(100):
                publisher.publish([record] * 8)
            time.sleep(0.002)
        for _ in range(500):  # the thread sends all 5000 batches (most dropped by the socket), never blocked
            if len(publisher.buffer) > 5000:
                break
            time.sleep(0.01)
        assert len(publisher.buffer) == 5001 and publisher.num_dropped == 0  # and the first AllBlocksCleared
        t0 = time.monotonic()
        publisher.close()
        assert not publisher.thread.is_alive() and time.monotonic() - t0 < 2

        full = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"ipc://{tmp_path}/kv2", max_queue_size=1)
        publisher = KVEventPublisher(full, 16, (0,))
        t0 = time.monotonic()
        for _ in range(2000):
            publisher.publish([record])
        assert time.monotonic() - t0 < 1.0 and publisher.num_dropped > 0
        publisher.close()
    finally:
        sub.close(linger=0)
        ctx.term()


@pytest.mark.parametrize("bad, message", [
    ("{", "kv_events_config is not valid JSON"),
    ('{"publisher": "kafka"}', "kv_events_config: publisher must be"),
    ('{"enable_kv_cache_events": true, "endpoint": "localhost:5557"}', "kv_events_config: endpoint must be"),
    ('{"buffer_steps": 0}', "kv_events_config: buffer_steps must be"),
    ('{"topics": "x"}', "kv_events_config: unknown key"),
])
def test_malformed_config_names_the_flag(bad, message):
    with pytest.raises(ValueError, match=message) as e:
        EngineConfig(kv_events_config=bad)
    assert "\n" not in str(e.value)
    assert EngineConfig(kv_events_config='{"enable_kv_cache_events": true}').kv_events_config.publisher == "zmq"
    assert not EngineConfig(kv_events_config="{}").kv_events_config.enabled


def test_each_kv_group_publishes_its_blocks(tmp_path, monkeypatch):
    """A model with sliding-window layers: each KV group stores the prompt's blocks, named by group_idx, kind and
    window (vLLM's fields), under the same hashes."""
    from pagoda.engine.demo import build_tiny_checkpoint

    monkeypatch.setenv("PYTHONHASHSEED", SEED)
    path = build_tiny_checkpoint(str(tmp_path / "gemma3"), "gemma3", initializer_range=0.3, sliding_window=16,
                                 layer_types=["sliding_attention", "full_attention"], head_dim=16,
                                 query_pre_attn_scalar=24, num_hidden_layers=2)
    endpoint, replay = f"ipc://{tmp_path}/kv", f"ipc://{tmp_path}/replay"
    llm = LLM(path, dtype="float32", num_kv_blocks=32, kv_events_config={
        "enable_kv_cache_events": True, "endpoint": endpoint, "replay_endpoint": replay})
    sub = Subscriber(endpoint, replay, "")
    try:
        prompt = list(range(1, 41))
        events = run(llm, prompt, sub)
    finally:
        sub.close()
        llm.engine.close()
    stored = sorted((e for e in events if isinstance(e, BlockStored)), key=lambda e: e.group_idx)
    assert [(e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) for e in stored] == [
        (0, "full_attention", None), (1, "sliding_window", 16)]
    assert all(e.block_hashes == router_hashes(prompt) and e.token_ids == prompt[:32] for e in stored)


def test_pagoda_serve_publishes(tmp_path):
    """`pagoda serve --kv-events-config`: a completion's blocks arrive, hashed as a router rebuilds them from the
    request's token ids; SIGTERM ends the publisher with the server. (The engine in a thread of the server: a
    child process builds the same EngineCore, and costs seconds more to start.)"""
    import json
    import urllib.request

    from grpc_fixtures import ServeProcess

    endpoint, replay = f"ipc://{tmp_path}/kv", f"ipc://{tmp_path}/replay"
    config = json.dumps({"enable_kv_cache_events": True, "endpoint": endpoint, "replay_endpoint": replay,
                         "topic": "kv@pod@tiny"})
    srv = ServeProcess(tiny_checkpoint(), "--served-model-name", "tiny",
                       "--kv-events-config", config, env={"PYTHONHASHSEED": SEED}).wait_ready()
    sub = Subscriber(endpoint, replay, "kv@pod@tiny")
    try:
        prompt = list(range(60, 110))  # 3 full blocks and 2 tokens
        body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 1}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{srv.http_port}/v1/completions", body,
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as r:
            assert r.status == 200
        for _ in range(50):
            sub.poll(100)
            sub.fill_gaps()
            stored = [e for e in sub.events() if isinstance(e, BlockStored)]
            if stored:
                break
        assert sub.events()[0] == AllBlocksCleared()
        [event] = stored
        assert event.token_ids == prompt[:48] and event.block_hashes == router_hashes(prompt)
        srv.proc.terminate()
        assert srv.proc.wait(30) == 0
    finally:
        sub.close()
        srv.kill()
