"""A SentencePiece tokenizer with byte fallback (the kind Llama 2, Mistral, Gemma and Phi-3 use),
trained here on a short multilingual text and loaded as transformers' LlamaTokenizer: the common
Latin text gets word pieces, rarer characters (CJK, emoji, Cyrillic...) are spelled in byte
tokens <0xE6> etc. Nothing is downloaded."""
import io
import os

TRAINING_TEXT = (
    "The quick brown fox jumps over the lazy dog. A small model speaks.\n" * 60
    + "Über Öl und Größe sprechen wir morgen. Café au lait, naïve résumé.\n" * 15
    + "寿司を食べる。寿司が好きです。\n" * 3
    + "Emoji 🎉🚀 are fun. Привет, как дела? 你好世界。 Ελληνικά κείμενα.\n")


def build_sentencepiece_tokenizer(path: str):
    """Trains the model into `path` (tokenizer.model, then tokenizer.json) and returns the tokenizer."""
    import sentencepiece as spm
    from transformers import LlamaTokenizer

    os.makedirs(path, exist_ok=True)
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(TRAINING_TEXT.splitlines()), model_writer=model, vocab_size=400, model_type="bpe",
        byte_fallback=True, character_coverage=0.98, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        normalization_rule_name="identity", minloglevel=2)
    with open(os.path.join(path, "tokenizer.model"), "wb") as f:
        f.write(model.getvalue())
    tokenizer = LlamaTokenizer.from_pretrained(path)
    tokenizer.save_pretrained(path)
    return tokenizer
