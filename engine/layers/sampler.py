"""Next-token choice for a whole batch at once: penalties, temperature, top-k, top-p, min-p,
then greedy rows take the argmax and the rest sample by an exponential race (which lets a
seeded row draw from its own generator, whatever else is in the batch)."""
from dataclasses import dataclass

import numpy as np
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


_NEG_INF_BITS = -8388608  # float32 -inf as an int32 (0xFF800000)


def apply_allowed(logits: torch.Tensor, rows: torch.Tensor | None, bits: torch.Tensor, rescue: bool) -> None:
    """-inf outside each constrained row's allowed tokens (bits: int32 [R, ceil(vocab / 32)], bit j of word
    w is token 32 * w + j; rows None: every row). With `rescue` (the step banned tokens), a row left with
    nothing (min_tokens or logit_bias banned all the grammar allows) keeps the grammar's set."""
    sub = logits if rows is None else logits[rows]  # [R, vocab] float32
    allowed = _unpack(bits, logits.shape[-1])  # uint8 [R, vocab], 1: allowed
    if sub.device.type == "cpu":
        # as bits, vectorised: 6x faster than masked_fill_ on CPU (keep: all ones where allowed)
        keep = allowed.to(torch.int32).neg_()
        as_int = sub.view(torch.int32)
        as_int.bitwise_and_(keep).bitwise_or_(keep.bitwise_not_().bitwise_and_(_NEG_INF_BITS))
    else:
        sub.masked_fill_(allowed == 0, float("-inf"))
    if rescue:
        stuck = (sub == float("-inf")).all(dim=-1, keepdim=True)
        sub = torch.where(stuck, torch.zeros_like(sub).masked_fill_(allowed == 0, float("-inf")), sub)
    if rows is not None or rescue:
        logits[rows if rows is not None else slice(None)] = sub


def _unpack(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 bitmasks [R, words] -> uint8 [R, vocab_size] of 0/1."""
    if bits.device.type == "cpu":
        return torch.from_numpy(np.unpackbits(bits.numpy().view(np.uint8), axis=-1, bitorder="little")[:, :vocab_size])
    shifts = torch.arange(32, dtype=torch.int32, device=bits.device)
    return ((bits[:, :, None] >> shifts) & 1).to(torch.uint8).view(len(bits), -1)[:, :vocab_size]


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
