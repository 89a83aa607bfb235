"""Next-token choice for a whole batch at once: penalties, temperature, top-k, top-p, min-p,
then greedy rows take the argmax and the rest sample by an exponential race (which lets a
seeded row draw from its own generator, whatever else is in the batch)."""
import functools
from dataclasses import dataclass

import torch


@dataclass
class SamplingTensors:
    temperature: torch.Tensor  # [num_seqs] float32; 0 for greedy rows
    top_k: torch.Tensor | None  # [num_seqs] int64, vocab size where off
    top_p: torch.Tensor | None  # [num_seqs] float32
    min_p: torch.Tensor | None  # [num_seqs] float32
    is_greedy: torch.Tensor  # [num_seqs] bool
    all_greedy: bool
    generators: list[tuple[int, torch.Generator]]  # seeded rows
    # (rows, token ids, values) added to single logits: logit_bias, -inf bans (min_tokens, bias -100)
    logit_adds: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    penalties: "PenaltyTensors | None" = None
    # structured outputs: (rows or None for all, int32 bitmasks [R, ceil(vocab / 32)]) of the tokens each row may take
    allowed: tuple[torch.Tensor, torch.Tensor] | None = None
    num_top_logprobs: int = -1  # -1: no logprobs this step


@dataclass
class PenaltyTensors:
    rows: torch.Tensor  # [R] rows of the batch that have penalties
    prompt_mask: torch.Tensor  # [R, vocab] bool: token appears in the prompt
    output_counts: torch.Tensor  # [R, vocab] float32: times generated so far
    repetition: torch.Tensor  # [R]
    presence: torch.Tensor  # [R]
    frequency: torch.Tensor  # [R]


def apply_penalties(logits: torch.Tensor, p: PenaltyTensors) -> None:
    sub = logits[p.rows]  # [R, vocab]
    seen = p.prompt_mask | (p.output_counts > 0)
    rep = p.repetition[:, None]
    sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    sub -= p.frequency[:, None] * p.output_counts + p.presence[:, None] * (p.output_counts > 0)
    logits[p.rows] = sub


def top_k_top_p_mask(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Logits with tokens outside each row's top-k and top-p sets at -inf."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        ranks = torch.arange(logits.shape[-1], device=logits.device)
        sorted_logits.masked_fill_(ranks[None, :] >= top_k[:, None], float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # keep a token while the mass above it < top_p
        drop = mass_before >= top_p[:, None]
        drop[:, 0] = False  # the most likely token always stays (top_p 0: only it)
        sorted_logits.masked_fill_(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def apply_allowed(logits: torch.Tensor, rows: torch.Tensor | None, bits: torch.Tensor, rescue: bool) -> None:
    """-inf outside each constrained row's allowed tokens (bits: int32 [R, ceil(vocab / 32)], bit j of word
    w is token 32 * w + j; rows None: every row), in two passes over the constrained rows only: each
    bitmask byte looked up as its 8 tokens' 0 / -inf, then added in place. With `rescue` (the step banned
    tokens), a row left with nothing (min_tokens or logit_bias banned all the grammar allows) keeps the
    grammar's set."""
    vocab = logits.shape[-1]
    table = _byte_masks(logits.device)
    # bits as bytes, little-endian: byte b of word w holds tokens 32 * w + 8 * b ... + 7
    add = torch.nn.functional.embedding(bits.view(torch.uint8).long(), table)  # [R, 4 * words, 8]
    add = add.view(len(bits), -1)[:, :vocab]  # [R, vocab] float32: 0 allowed, -inf not
    if rows is None:
        logits.add_(add)
    else:
        logits.index_add_(0, rows, add)
    if rescue:
        sub = logits if rows is None else logits[rows]
        stuck = (sub == float("-inf")).all(dim=-1, keepdim=True)
        logits[rows if rows is not None else slice(None)] = torch.where(stuck, add, sub)


@functools.cache
def _byte_masks(device: torch.device) -> torch.Tensor:
    """float32 [256, 8]: a bitmask byte's 8 tokens, 0 where its bit is set, else -inf."""
    set_ = (torch.arange(256)[:, None] >> torch.arange(8)) & 1
    return torch.zeros(256, 8).masked_fill_(set_ == 0, float("-inf")).to(device)


def min_p_mask(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    probs = logits.softmax(dim=-1)
    keep = probs >= min_p[:, None] * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(~keep, float("-inf"))


class Sampler:
    def __init__(self, seed: int, device: torch.device, argmax=None):
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.argmax = argmax or _argmax  # [num_seqs, vocab] float32 -> [num_seqs]; a backend may bring its own

    def __call__(self, logits: torch.Tensor, t: SamplingTensors):
        """logits: [num_seqs, vocab] -> (token ids [num_seqs], logprobs or None)."""
        logits = logits.float()
        logprobs = _logprobs(logits, t.num_top_logprobs) if t.num_top_logprobs >= 0 else None
        if t.penalties is not None:
            apply_penalties(logits, t.penalties)
        if t.logit_adds is not None:
            logits.index_put_(t.logit_adds[:2], t.logit_adds[2], accumulate=True)
        if t.allowed is not None:
            apply_allowed(logits, *t.allowed, rescue=t.logit_adds is not None)
        greedy = self.argmax(logits)
        if t.all_greedy:
            return greedy, logprobs
        temperature = torch.where(t.is_greedy, 1.0, t.temperature)
        logits = logits / temperature[:, None]
        if t.top_k is not None or t.top_p is not None:
            logits = top_k_top_p_mask(logits, t.top_k, t.top_p)
        if t.min_p is not None:
            logits = min_p_mask(logits, t.min_p)
        probs = logits.softmax(dim=-1)
        race = torch.empty_like(probs).exponential_(generator=self.generator)
        for row, gen in t.generators:
            race[row].exponential_(generator=gen)
        sampled = self.argmax(probs / race)
        return torch.where(t.is_greedy, greedy, sampled), logprobs


def _argmax(x: torch.Tensor) -> torch.Tensor:
    # x: [num_seqs, vocab] -> [num_seqs]; max's indices (the first maximum, as argmax) are 3x
    # faster than argmax on CPU
    return x.max(dim=-1).indices


def _logprobs(logits: torch.Tensor, k: int):
    """The model's own log-probabilities (before penalties and temperature)."""
    lp = logits.log_softmax(dim=-1)
    top = lp.topk(k, dim=-1) if k > 0 else None
    return lp, top
