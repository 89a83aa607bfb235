"""A small model trained here, for benchmarks where random weights mean nothing (speculative
decoding's acceptance rates): a Llama-shaped target and a smaller draft with the same tokenizer,
trained for a few minutes on text that ships with every Python (the standard library's own source).
The draft is distilled from its target (trained on the target's next-token distributions, not the
text's tokens): what a draft is for is agreeing with its target, and that is what sets the acceptance
of its proposals (DistillSpec, Zhou et al. 2023; a draft trained on the text alone agreed with the
target on 43% of held-out tokens here).

Deterministic from its seed for a given thread count, and cached: the checkpoints land in
~/.cache/pagoda/trained/<key>/{target,draft} (PAGODA_CACHE moves the root), with each model's loss
curve in loss.json beside its weights. Not used by the tests.

    python benchmarks/trained_model.py --steps 600            # builds (or finds) both, prints the paths
"""
import argparse
import glob
import hashlib
import json
import os
import sysconfig
import time

TOKENIZER_VOCAB = 2048
SPECIALS = ["<|bos|>", "<|eos|>", "<|pad|>"]
# hidden, layers, heads, kv heads, intermediate: the target about 8x the draft's compute per token
SHAPES = {"target": dict(hidden_size=256, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4,
                         intermediate_size=768),
          "draft": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=384)}
# a larger target whose float32 weights (~60 MB) do not fit in the CPU's caches, as a real model's do not
# (--target-size large): trained with the small one's tokenizer, with a draft of the small shape distilled from it
LARGE_SHAPE = dict(hidden_size=384, num_hidden_layers=8, num_attention_heads=6, num_key_value_heads=2,
                   intermediate_size=1152)
SEQ_LEN = 128
VERSION = "2"  # 2: drafts distilled from their targets


def corpus(max_bytes: int) -> str:
    """The standard library's .py files, in path order, each after a comment naming it, up to max_bytes."""
    root = sysconfig.get_paths()["stdlib"]
    parts, size = [], 0
    for path in sorted(glob.glob(os.path.join(root, "*.py")) + glob.glob(os.path.join(root, "*", "*.py"))):
        if "test" in os.path.relpath(path, root).split(os.sep)[0]:
            continue
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f"# {os.path.relpath(path, root)}\n{f.read()}\n"
        parts.append(text)
        size += len(text)
        if size >= max_bytes:
            break
    return "".join(parts)[:max_bytes]


def train_tokenizer(text: str, path: str):
    """A byte-level BPE tokenizer of TOKENIZER_VOCAB tokens trained on the text, saved at path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text[i:i + 65536] for i in range(0, len(text), 65536)], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>",
                                   pad_token="<|pad|>")
    fast.save_pretrained(path)
    return fast


def train(name: str, ids, steps: int, batch: int, seed: int, path: str, tokenizer, shape=None,
          teacher: str | None = None) -> list[float]:
    """Trains one model on windows of ids (with a teacher checkpoint: on the teacher's next-token
    distributions there, the cross-entropy against them); saves it (safetensors) with its loss curve;
    returns the curve."""
    import torch
    import torch.nn.functional as F
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), max_position_embeddings=4096, tie_word_embeddings=True,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, **(shape or SHAPES[name]))
    model = LlamaForCausalLM(config)
    teacher_model = None if teacher is None else LlamaForCausalLM.from_pretrained(teacher).eval()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps, pct_start=0.05)
    g = torch.Generator().manual_seed(seed)
    losses, t0 = [], time.monotonic()
    for step in range(steps):
        starts = torch.randint(0, len(ids) - SEQ_LEN - 1, (batch,), generator=g)
        x = torch.stack([ids[s:s + SEQ_LEN] for s in starts.tolist()])  # x: [batch, seq_len]
        if teacher_model is None:
            loss = model(input_ids=x, labels=x).loss
        else:
            with torch.no_grad():
                soft = teacher_model(input_ids=x).logits.softmax(dim=-1)  # soft: [batch, seq_len, vocab]
            loss = F.cross_entropy(model(input_ids=x).logits.flatten(0, 1), soft.flatten(0, 1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(round(loss.item(), 4))
        if step % 50 == 0 or step == steps - 1:
            print(f"{name} step {step}/{steps} loss {losses[-1]:.3f} ({time.monotonic() - t0:.0f} s)", flush=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    with open(os.path.join(path, "loss.json"), "w") as f:
        json.dump({"steps": steps, "batch": batch, "seq_len": SEQ_LEN, "seed": seed, "teacher": teacher,
                   "loss": losses, "seconds": round(time.monotonic() - t0, 1)}, f)
    return losses


def build(steps: int = 600, batch: int = 8, seed: int = 0, corpus_bytes: int = 8 << 20,
          root: str | None = None) -> dict[str, str]:
    """{"target": path, "draft": path}, trained now or found in the cache."""
    import torch

    text = corpus(corpus_bytes)
    key = hashlib.sha256(json.dumps([VERSION, SHAPES, SEQ_LEN, steps, batch, seed, torch.get_num_threads()]).encode()
                         + hashlib.sha256(text.encode()).digest()).hexdigest()[:16]
    root = root or os.path.join(os.environ.get("PAGODA_CACHE") or os.path.expanduser("~/.cache/pagoda"),
                                "trained", key)
    paths = {name: os.path.join(root, name) for name in SHAPES}
    if all(os.path.exists(os.path.join(p, "loss.json")) for p in paths.values()):
        return paths
    os.makedirs(root, exist_ok=True)
    tokenizer = train_tokenizer(text, os.path.join(root, "tokenizer"))
    ids = torch.tensor(tokenizer(text)["input_ids"], dtype=torch.int64)
    print(f"corpus: {len(text) / 1e6:.1f} MB, {len(ids) / 1e6:.2f}M tokens", flush=True)
    train("target", ids, steps, batch, seed, paths["target"], tokenizer)
    train("draft", ids, steps, batch, seed, paths["draft"], tokenizer, teacher=paths["target"])
    return paths


def build_large(steps: int = 400, small_steps: int = 600, batch: int = 8, seed: int = 0,
                corpus_bytes: int = 8 << 20) -> dict[str, str]:
    """{"target": the larger target, "draft": its draft (the small draft's shape, distilled from it)}: trained
    now (with the small build's tokenizer, built first if needed) or found in the cache."""
    import torch
    from transformers import AutoTokenizer

    small = build(small_steps, batch, seed, corpus_bytes)
    tokenizer_path = os.path.join(os.path.dirname(small["target"]), "tokenizer")
    key = hashlib.sha256(json.dumps([VERSION, LARGE_SHAPE, SEQ_LEN, steps, batch, seed, torch.get_num_threads(),
                                     small["target"]]).encode()).hexdigest()[:16]
    root = os.path.join(os.path.dirname(os.path.dirname(small["target"])), f"large-{key}")
    paths = {"target": os.path.join(root, "target"), "draft": os.path.join(root, "draft")}
    if not all(os.path.exists(os.path.join(p, "loss.json")) for p in paths.values()):
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        ids = torch.tensor(tokenizer(corpus(corpus_bytes))["input_ids"], dtype=torch.int64)
        if not os.path.exists(os.path.join(paths["target"], "loss.json")):
            train("target-large", ids, steps, batch, seed, paths["target"], tokenizer, LARGE_SHAPE)
        train("draft", ids, small_steps, batch, seed, paths["draft"], tokenizer, teacher=paths["target"])
    return paths


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--corpus-mb", type=float, default=8.0)
    p.add_argument("--out", help="a directory instead of the cache")
    p.add_argument("--target-size", choices=["small", "large"], default="small",
                   help="large: a target whose weights do not fit in the CPU's caches (--large-steps steps)")
    p.add_argument("--large-steps", type=int, default=400)
    p.add_argument("--threads", type=int, help="torch threads (part of the cache key; the benchmarks pass theirs)")
    args = p.parse_args()
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    if args.target_size == "large":
        paths = build_large(args.large_steps, args.steps, args.batch, args.seed, int(args.corpus_mb * 2**20))
    else:
        paths = build(args.steps, args.batch, args.seed, int(args.corpus_mb * 2**20), args.out)
    for name, path in paths.items():
        with open(os.path.join(path, "loss.json")) as f:
            loss = json.load(f)["loss"]
        print(f"{name}: {path} (loss {loss[0]:.2f} -> {sum(loss[-20:]) / len(loss[-20:]):.2f})")


if __name__ == "__main__":
    main()
