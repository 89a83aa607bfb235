"""The sentence-transformers layout (engine/pooling.py): a tiny Qwen3 laid out as Qwen3-Embedding ships, and
Llama ones pooled by mean and CLS, give the vectors SentenceTransformer(path).encode gives, in float32."""
import numpy as np
import pytest
from embedding_fixtures import MAX_SEQ_LENGTH, build_embedding_checkpoint
from pagoda.engine import LLM
from pagoda.engine.errors import InvalidRequestError
from pagoda.engine.pooling import PoolerConfig, PoolingParams, read_sentence_transformers

TEXTS = ["hello world", "Grüße aus Köln — 東京 🚀", "a", "the quick brown fox jumps over the lazy dog; " * 3]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return build_embedding_checkpoint(str(tmp_path_factory.mktemp("qwen3-embedding")))


def st_encode(path, texts, **kw):
    from sentence_transformers import SentenceTransformer

    truncate_dim = kw.pop("truncate_dim", None)
    return SentenceTransformer(path, device="cpu", truncate_dim=truncate_dim).encode(texts, convert_to_numpy=True, **kw)


def embed(llm: LLM, texts, **kw) -> np.ndarray:
    return np.stack([o.embedding for o in llm.embed(texts, **kw)])


def assert_same(ours: np.ndarray, theirs: np.ndarray) -> None:
    cos = (ours * theirs).sum(-1) / np.linalg.norm(ours, axis=-1) / np.linalg.norm(theirs, axis=-1)
    assert cos.min() >= 0.9999
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-5)


def llm(path, **kw) -> LLM:
    return LLM(path, dtype="float32", device="cpu", num_kv_blocks=64, **kw)


def test_qwen3_embedding_layout_equals_sentence_transformers(qwen3):
    engine = llm(qwen3)
    assert engine.config.runner == "pooling" and engine.config.max_model_len == MAX_SEQ_LENGTH
    assert engine.engine.pooler.method == "last" and engine.engine.pooler.normalize
    ours = embed(engine, TEXTS)
    assert ours.dtype == np.float32 and ours.shape == (len(TEXTS), 64)
    assert_same(ours, st_encode(qwen3, TEXTS))
    # the tokenizer's post-processor appended EOS: that is the token pooled
    assert engine.tokenizer(TEXTS[0])["input_ids"][-1] == engine.tokenizer.eos_token_id
    # token ids in: the same vectors
    ids = [engine.tokenizer(t)["input_ids"] for t in TEXTS]
    assert_same(embed(engine, ids), ours)
    # chunked prefill (16 tokens a step) changes nothing
    assert_same(embed(llm(qwen3, max_num_batched_tokens=16), TEXTS), ours)


def test_qwen3_embedding_dimensions_and_query_prompt(qwen3):
    engine = llm(qwen3)
    ours = embed(engine, TEXTS, pooling_params=PoolingParams(dimensions=16))
    assert ours.shape == (len(TEXTS), 16)
    assert_same(ours, st_encode(qwen3, TEXTS, truncate_dim=16, normalize_embeddings=True))
    short = TEXTS[:3]  # the prompt and the long text are more than max_seq_length
    assert_same(embed(engine, short, prompt_name="query"), st_encode(qwen3, short, prompt_name="query"))
    with pytest.raises(InvalidRequestError, match="not one of this model's prompts") as e:
        engine.embed(TEXTS, prompt_name="passage")
    assert e.value.field == "prompt_name"


def test_max_seq_length_caps_the_input(qwen3):
    engine = llm(qwen3)
    long = "x" * (MAX_SEQ_LENGTH + 10)
    with pytest.raises(InvalidRequestError, match=f"is {MAX_SEQ_LENGTH + 11} tokens"):
        engine.embed(long)
    out = engine.embed(long, PoolingParams(truncate_prompt_tokens=MAX_SEQ_LENGTH))[0]
    assert out.num_prompt_tokens == MAX_SEQ_LENGTH


def test_a_checkpoint_without_a_head_loads_for_pooling(tmp_path):
    """Qwen3-Embedding-4B and 8B ship the base model's tensors only, untied: no lm_head at all."""
    path = build_embedding_checkpoint(str(tmp_path / "untied"), tied=False, seed=3)
    assert_same(embed(llm(path), TEXTS), st_encode(path, TEXTS))
    with pytest.raises(ValueError, match="lacks weights for: lm_head.weight"):
        llm(path, runner="all")  # generation needs the head


@pytest.mark.parametrize("pooling,normalize", [("mean_tokens", False), ("cls_token", True)])
def test_mean_and_cls_checkpoints_equal_sentence_transformers(tmp_path, pooling, normalize):
    path = build_embedding_checkpoint(str(tmp_path / pooling), arch="llama", pooling=pooling, normalize=normalize,
                                      eos=False, seed=1)
    engine = llm(path, max_num_batched_tokens=16)
    assert (engine.engine.pooler.method, engine.engine.pooler.normalize) == (pooling.split("_")[0], normalize)
    assert_same(embed(engine, TEXTS), st_encode(path, TEXTS))


def test_runner_auto_and_the_pooling_override(qwen3, checkpoint):
    assert llm(checkpoint("llama")).config.runner == "generate"
    engine = llm(qwen3, pooling="mean,no-normalize")
    assert (engine.engine.pooler.method, engine.engine.pooler.normalize) == ("mean", False)
    assert engine.engine.pooler.max_seq_length == MAX_SEQ_LENGTH  # the files' still
    # the mean of the same hidden states the last-token vectors come from
    mean = embed(engine, TEXTS[:1])
    assert np.linalg.norm(mean) != pytest.approx(1.0)
    plain = llm(checkpoint("llama"), runner="pooling")
    assert plain.engine.pooler == PoolerConfig("last", True)  # vLLM's default for a decoder


def test_pooler_config_parse():
    assert PoolerConfig.parse("last,normalize") == PoolerConfig("last", True)
    assert PoolerConfig.parse("cls, no-normalize") == PoolerConfig("cls", False)
    assert PoolerConfig.parse('{"pooling_type": "MEAN", "normalize": false}') == PoolerConfig("mean", False)
    assert PoolerConfig.parse('{"classifier_from_token": ["no", "yes"]}').classifier_from_token == ("no", "yes")
    for bad, why in (("max", "method must be one of"), ("last,unit", "unknown flag"), ('{"x": 1}', "unknown key"),
                     ("{", "not valid JSON"), ('{"classifier_from_token": ["yes"]}', "must be two tokens")):
        with pytest.raises(ValueError, match=why):
            PoolerConfig.parse(bad)


def test_unsupported_sentence_transformers_modules_are_refused(tmp_path):
    path = build_embedding_checkpoint(str(tmp_path / "dense"), seed=2)
    (tmp_path / "dense" / "modules.json").write_text(
        '[{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},'
        ' {"idx": 1, "name": "1", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}]')
    with pytest.raises(ValueError, match="Dense are not supported"):
        read_sentence_transformers(path)
    (tmp_path / "dense" / "modules.json").write_text(
        '[{"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]')
    (tmp_path / "dense" / "1_Pooling" / "config.json").write_text('{"pooling_mode_max_tokens": true}')
    with pytest.raises(ValueError, match="pooling pooling_mode_max_tokens is not supported"):
        read_sentence_transformers(path)
