"""KV-cache events for a KV-aware router (llm-d's KV indexer, NVIDIA Dynamo), in vLLM's format
(vllm/distributed/kv_events.py), published over ZMQ as vLLM's ZmqEventPublisher does.

The block manager records what it does as plain tuples into a list (only when events are on):

    ("stored", group, hash, parent hash or None, token ids, hash seed, LoRA name, LoRA id)   register_full_blocks
    ("removed", group, hash)                                                                  _grow evicting a block

Hashes there are whole sha256 digests (engine/core/block_hash.py); events carry their keys, the last 8 bytes.

The engine core hands each step's list to publish(), which only puts it on a bounded queue (full: the batch
is dropped and counted). A thread turns the tuples into vLLM's events, encodes the batch with msgpack and
sends it on a PUB socket as three frames (topic, sequence number as 8 bytes big-endian, payload); a
subscriber past the socket's high-water mark loses messages, it never stalls the engine. The last
buffer_steps batches are kept for the ROUTER socket at replay_endpoint: a request of 8 bytes (the first
sequence number wanted) is answered with (sequence number, payload) for each kept batch from there, then
(-1, b"").

Encoding: msgspec Structs with array_like=True and tag=True, as vLLM up to 0.23 encodes them (events as
arrays: [tag, fields...]); every consumer decodes this (vLLM 0.24+ encodes events as maps, which llm-d
0.9+ and Dynamo also read). Fields are the current ones: BlockStored's medium, lora_name, extra_keys,
group_idx and kv_cache_spec_* follow lora_id. Each KV group publishes its own blocks (group_idx, with its
kind and window): a model with sliding-window layers stores and removes a block once per group.
"""
import logging
import queue
import threading
import time
from collections import deque

import msgspec
import zmq

from pagoda.engine.config import KVEventsConfig
from pagoda.engine.core.block_hash import KEY_MASK

log = logging.getLogger("pagoda.engine")
MEDIUM = "GPU"  # vLLM's name for the engine's own KV cache, whatever the device
END_SEQ = (-1).to_bytes(8, "big", signed=True)


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


def to_events(records: list, block_size: int, windows: tuple[int, ...]) -> list[KVCacheEvent]:
    """The block manager's records as vLLM's events: a run of blocks stored one after another (each the
    parent of the next, in one group and adapter) is one BlockStored; removals in a row, one BlockRemoved."""
    out = []
    for r in records:
        last = out[-1] if out else None
        if r[0] == "stored":
            _, group, h, parent, tokens, extra, lora_name, lora_id = r
            h, parent = h & KEY_MASK, None if parent is None else parent & KEY_MASK
            if isinstance(last, BlockStored) and last.group_idx == group and last.block_hashes[-1] == parent \
                    and last.extra_keys[-1] == extra:
                last.block_hashes.append(h)
                last.token_ids.extend(tokens)
                last.extra_keys.append(extra)
                continue
            window = windows[group]
            out.append(BlockStored([h], parent, list(tokens), block_size, lora_id if lora_name else None, MEDIUM,
                                   lora_name, [extra], group, "sliding_window" if window else "full_attention",
                                   window or None))
        elif r[0] == "removed":
            _, group, h = r
            if isinstance(last, BlockRemoved) and last.group_idx == group:
                last.block_hashes.append(h & KEY_MASK)
                continue
            out.append(BlockRemoved([h & KEY_MASK], MEDIUM, group))
        else:
            out.append(AllBlocksCleared())
    return out


class KVEventPublisher:
    """vLLM's ZmqEventPublisher: PUB (and replay ROUTER) sockets driven by one thread off the engine step."""

    def __init__(self, config: KVEventsConfig, block_size: int, windows: tuple[int, ...]):
        self.config, self.block_size, self.windows = config, block_size, windows
        self.queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self.num_dropped = 0  # batches the queue had no room for
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.SNDHWM, config.hwm)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.replay = None
        try:
            _attach(self.pub, config.endpoint)
            if config.replay_endpoint is not None:
                self.replay = self.ctx.socket(zmq.ROUTER)
                self.replay.setsockopt(zmq.LINGER, 0)
                self.replay.bind(config.replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            where = config.endpoint if self.replay is None else config.replay_endpoint
            raise ValueError(f"kv_events_config: cannot open {where}: {e}") from None
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="pagoda-kv-events", daemon=True)
        self.thread.start()
        # a restarted replica holds nothing: a subscriber drops what it indexed of the replica's last life
        self.publish([("cleared",)])

    def publish(self, records: list) -> None:
        """A step's records; never blocks (a full queue drops the batch)."""
        try:
            self.queue.put_nowait((time.time(), records))
        except queue.Full:
            self.num_dropped += 1
            if self.num_dropped == 1 or self.num_dropped % 1000 == 0:
                log.warning("KV-cache events: %d batches dropped (the publisher's queue is full)", self.num_dropped)

    def close(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=5)
        self._close_sockets()

    def _close_sockets(self) -> None:
        self.pub.close(linger=0)
        if self.replay is not None:
            self.replay.close(linger=0)
        self.ctx.term()

    def _run(self) -> None:
        encoder, seq = msgspec.msgpack.Encoder(), 0
        topic = self.config.topic.encode()
        while not (self.stopping.is_set() and self.queue.empty()):
            if self.replay is not None and self.replay.poll(0):
                self._serve_replay()
            try:
                ts, records = self.queue.get(timeout=0.05)
            except queue.Empty:
                continue
            try:
                batch = KVEventBatch(ts, to_events(records, self.block_size, self.windows), 0)
                payload = encoder.encode(batch)
                try:
                    self.pub.send_multipart((topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
                except zmq.Again:  # PUB drops past its high-water mark by itself; a connecting one may raise
                    pass
                self.buffer.append((seq, payload))
                seq += 1
            except Exception:  # an event is never worth the engine: log, go on
                log.exception("KV-cache events: publishing a batch failed")

    def _serve_replay(self) -> None:
        frames = self.replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("KV-cache events: malformed replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        start = int.from_bytes(start, "big")
        for seq, payload in list(self.buffer):
            if seq >= start:
                self.replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self.replay.send_multipart((client, b"", END_SEQ, b""))


def _attach(socket, endpoint: str) -> None:
    """vLLM's rule: bind an address with a wildcard (or ipc://, inproc://), connect to any other (llm-d's
    endpoint picker binds, the model servers connect to it)."""
    if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
        socket.bind(endpoint)
    else:
        socket.connect(endpoint)
