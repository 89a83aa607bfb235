"""Decode steps replayed from CUDA graphs: one graph per batch-size bucket, captured at start-up
over persistent input buffers. A batch is copied into the smallest bucket that holds it; the
padding rows write nothing (slot -1) and attend to nothing (context 0)."""
import logging

import torch

from pagoda.engine.layers.attention import AttentionMetadata

log = logging.getLogger("pagoda.engine")


def buckets(max_batch: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_batch + 1, 16))
    return sorted({s for s in sizes if s <= max_batch} | {max_batch})


class DecodeGraphs:
    def __init__(self, model, max_batch: int, max_blocks_per_seq: int, block_size: int, device: torch.device,
                 max_query_len: int = 1):
        self.model, self.block_size = model, block_size
        self.max_query_len = max_query_len  # query tokens per sequence the graphs are captured for
        self.buckets = buckets(max_batch)
        i64, i32 = dict(dtype=torch.int64, device=device), dict(dtype=torch.int32, device=device)
        num_tokens = max_batch * max_query_len
        self.input_ids = torch.zeros(num_tokens, **i64)
        self.positions = torch.zeros(num_tokens, **i64)
        self.slot_mapping = torch.full((num_tokens,), -1, **i64)
        self.block_tables = torch.zeros(max_batch, max_blocks_per_seq, **i32)
        self.context_lens = torch.zeros(max_batch, **i32)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}  # each graph's output buffer

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def _meta(self, n: int) -> AttentionMetadata:
        empty = self.context_lens[:0]
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:n], num_decode_tokens=n, decode_block_tables=self.block_tables[:n],
            decode_context_lens=self.context_lens[:n], prefill_block_tables=self.block_tables[:0],
            prefill_query_start_loc=empty, prefill_context_lens=empty, max_query_len=self.max_query_len,
            max_context_len=self.block_tables.shape[1] * self.block_size)

    def _forward(self, n: int) -> torch.Tensor:
        hidden = self.model(self.input_ids[:n], self.positions[:n], self._meta(n))
        return self.model.compute_logits(hidden)  # [n, vocab]

    @torch.inference_mode()
    def capture(self) -> None:
        pool = None
        for n in reversed(self.buckets):  # largest first, so the smaller ones reuse its memory
            self._forward(n)  # compiles kernels, settles the allocator
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[n] = self._forward(n)
            pool = graph.pool()
            self.graphs[n] = graph
        torch.cuda.synchronize()

    @torch.inference_mode()
    def run(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        """A decode-only batch: -> logits [batch, vocab]. Replays a graph when one was captured
        (CUDA), else runs the same padded forward eagerly."""
        n = input_ids.shape[0]
        bucket = next(b for b in self.buckets if b >= n)
        width = meta.decode_block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.block_tables[:n, :width].copy_(meta.decode_block_tables)
        self.context_lens[:n].copy_(meta.decode_context_lens)
        self.slot_mapping[n:bucket].fill_(-1)
        self.context_lens[n:bucket].fill_(0)
        graph = self.graphs.get(bucket)
        if graph is None:
            return self._forward(bucket)[:n]
        graph.replay()
        return self.logits[bucket][:n]


def capture_checked(graphs: DecodeGraphs, eager_forward) -> bool:
    """Capture, then check one replay against the eager forward on the same inputs. On any
    failure keep running eagerly (a warning, not an error: graphs only buy speed)."""
    try:
        graphs.capture()
        n = min(3, graphs.max_batch)
        ids = torch.arange(1, n + 1, device=graphs.input_ids.device)
        pos = torch.zeros(n, dtype=torch.int64, device=ids.device)
        tables = torch.arange(n, dtype=torch.int32, device=ids.device)[:, None]  # scratch blocks 0..n-1
        ctx = torch.ones(n, dtype=torch.int32, device=ids.device)
        meta = graphs._meta(n)
        meta.slot_mapping = tables[:, 0].long() * graphs.block_size
        meta.decode_block_tables, meta.decode_context_lens = tables, ctx
        expected = eager_forward(ids, pos, meta)
        got = graphs.run(ids, pos, meta)
        if not torch.allclose(got.float(), expected.float(), rtol=1e-2, atol=1e-2):
            raise RuntimeError(f"replay differs from eager by {(got - expected).abs().max().item():.3g}")
        return True
    except Exception as e:  # noqa: BLE001
        log.warning("CUDA graphs disabled, decoding eagerly: %s", e)
        graphs.graphs.clear()
        graphs.logits.clear()
        return False
