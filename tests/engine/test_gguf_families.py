"""GGUF files of the dense families beside Llama and Qwen (engine/gguf.py _family_config): Gemma 2, Gemma 3 (text),
Phi-3, OLMo 2, Granite, SmolLM3, written as llama.cpp's convert script writes them (tests/gguf_fixtures.py). The
config from the metadata against the checkpoint's, every field the model reads; greedy output against
transformers: a float file over the checkpoint itself, a Q8_0 file over its weights as gguf.quants dequantizes
them. And a GGUF named by a Hugging Face hub id (REPO:QUANT, REPO/FILE.gguf), from a local hub cache offline."""
import os

import pytest
import torch
from conftest import FAMILIES
from gguf import GGMLQuantizationType as Q
from gguf_fixtures import LINEARS, dequantized_state, write_gguf
from grpc_fixtures import engine_config
from pagoda.engine import LLM, SamplingParams
from pagoda.engine.layers import quantization as qz
from pagoda.engine.layers.rotary import rope_parameters, rotary_dim
from pagoda.engine.loader import load_hf_config, load_tokenizer, resolve_model_path
from pagoda.engine.models.llama import layer_windows

pytestmark = pytest.mark.timeout(300)

# FAMILIES' configs, where llama.cpp cannot write them, as it can: Gemma 2 ties its head (the converter drops
# lm_head); Gemma's query scale is the head size (llama.cpp derives it: the head size, or hidden / heads for the
# 27B models); Gemma 3 has five sliding layers to a full one and SmolLM3 no RoPE every fourth layer (llama.cpp's
# constants). Phi-3.5 / Phi-4-mini's LongRoPE (its factors, tensors in the file) past an original context of 32.
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
            "short_factor": [1.0, 1.1, 1.2, 1.3], "long_factor": [2.0, 2.5, 3.0, 3.5],
            "original_max_position_embeddings": 32}
OVERRIDES = {"gemma2": dict(tie_word_embeddings=True, query_pre_attn_scalar=16),
             "gemma3": dict(num_hidden_layers=6, query_pre_attn_scalar=16,
                            layer_types=["sliding_attention"] * 5 + ["full_attention"]),
             "smollm3": dict(num_hidden_layers=4, no_rope_layer_interval=4),
             "phi3-longrope": dict(FAMILIES["phi3"], max_position_embeddings=256, original_max_position_embeddings=32,
                                   rope_parameters=LONGROPE)}
NAMES = ("gemma2", "gemma3", "phi3", "phi3-longrope", "olmo2", "granite", "smollm3")
Q8_0 = {kind: Q.Q8_0 for kind in (*LINEARS, "attn_qkv", "token_embd")}
PROMPT = list(range(7, 7 + qz.DEQUANT_MIN_ROWS + 12))  # past Gemma's window of 16; dequantized prefill, kernel decodes


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """family -> (checkpoint, float file, Q8_0 file)."""
    from pagoda.engine.demo import build_tiny_checkpoint

    root, out = tmp_path_factory.mktemp("gguf-families"), {}
    for name in NAMES:
        ckpt = build_tiny_checkpoint(str(root / name), **{**FAMILIES.get(name, {}), **OVERRIDES.get(name, {})})
        out[name] = (ckpt, write_gguf(ckpt, str(root / f"{name}-f32.gguf")),
                     write_gguf(ckpt, str(root / f"{name}-q8_0.gguf"), types=Q8_0, file_type=7))
    return out


def _greedy(model: str, n: int = 12) -> tuple[list[int], torch.Tensor]:
    """(greedy tokens after PROMPT, the logprob of each prompt token after the first): every position's logits
    checked, where a random tied head (Gemma 2's) makes greedy repeat one token."""
    llm = LLM(**vars(engine_config(model, num_kv_blocks=32, max_num_batched_tokens=128)))
    try:
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, prompt_logprobs=0)
        out = llm.generate([PROMPT], params)[0]
        return list(out.outputs[0].token_ids), torch.tensor([p.logprob for p in out.prompt_logprobs[1:]])
    finally:
        llm.engine.close()


def _reference(ckpt: str, state=None, n: int = 12) -> tuple[list[int], torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    if state is not None:
        missing, unexpected = model.load_state_dict(state, strict=False)
        assert not unexpected and not [m for m in missing if not (model.config.tie_word_embeddings and "lm_head" in m)]
    out = model.generate(torch.tensor([PROMPT]), max_new_tokens=n, do_sample=False, eos_token_id=None)
    with torch.no_grad():
        logprobs = model(torch.tensor([PROMPT])).logits[0, :-1].log_softmax(-1)
    return out[0, len(PROMPT):].tolist(), logprobs.gather(1, torch.tensor(PROMPT[1:])[:, None])[:, 0]


def _same(got, want) -> None:
    assert got[0] == want[0]
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=1e-3)


@pytest.mark.parametrize("name", NAMES)
def test_config_and_tokenizer_from_the_metadata(files, name):
    from transformers import AutoConfig, AutoTokenizer

    ckpt, path, _ = files[name]
    cfg, ref = load_hf_config(path), AutoConfig.from_pretrained(ckpt)
    assert cfg.architectures == ref.architectures and cfg.model_type == ref.model_type
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "vocab_size", "max_position_embeddings", "tie_word_embeddings", "bos_token_id", "eos_token_id",
                "pad_token_id", "head_dim", "query_pre_attn_scalar", "attn_logit_softcapping",
                "final_logit_softcapping", "sliding_window", "layer_types", "no_rope_layers",
                "original_max_position_embeddings", "use_sliding_window"):
        assert getattr(cfg, key, None) == getattr(ref, key, None), key
    for key in ("rms_norm_eps", "attention_multiplier", "embedding_multiplier", "residual_multiplier",
                "logits_scaling"):  # metadata floats are float32
        want = getattr(ref, key, None)
        assert getattr(cfg, key, None) == (want if want is None else pytest.approx(want, rel=1e-6)), key
    assert layer_windows(cfg) == layer_windows(ref)
    head_dim = getattr(ref, "head_dim", None) or ref.hidden_size // ref.num_attention_heads
    for kind in dict.fromkeys(getattr(ref, "layer_types", None) or [None]):
        want = {k: pytest.approx(v, rel=1e-6) if isinstance(v, (float, list)) else v
                for k, v in rope_parameters(ref, kind).items()}  # metadata and tensors: float32
        assert rope_parameters(cfg, kind) == want, kind
        assert rotary_dim(cfg, head_dim, kind) == rotary_dim(ref, head_dim, kind), kind
    tok, want = load_tokenizer(path), AutoTokenizer.from_pretrained(ckpt)
    text, chat = "héllo <|eos|> wörld\n", [{"role": "user", "content": "hi"}]
    assert tok.encode(text) == want.encode(text) and tok.decode(tok.encode(text)) == text
    assert tok.apply_chat_template(chat, tokenize=False) == want.apply_chat_template(chat, tokenize=False)


@pytest.mark.parametrize("name", NAMES)
def test_float_file_is_token_identical_to_transformers(files, name):
    ckpt, path, _ = files[name]
    _same(_greedy(path), _reference(ckpt))


@pytest.mark.parametrize("name", NAMES)
def test_q8_0_file_is_token_identical_to_transformers_on_its_weights(files, name):
    ckpt, _, path = files[name]
    _same(_greedy(path), _reference(ckpt, dequantized_state(path, load_hf_config(path))))


def test_refusals_name_the_file_and_the_field(tmp_path):
    """A field the family's files have, missing; an OLMo 3 file (llama.cpp writes it as olmo2, with windows)."""
    import gguf

    def write(name: str, window: int | None) -> str:
        w = gguf.GGUFWriter(str(tmp_path / name), "olmo2")
        w.add_embedding_length(64), w.add_head_count(4), w.add_block_count(2), w.add_context_length(128)
        w.add_layer_norm_rms_eps(1e-6)
        if window is not None:
            w.add_feed_forward_length(128), w.add_sliding_window(window)
        w.add_tensor("token_embd.weight", torch.zeros(8, 64).numpy())
        w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
        return str(tmp_path / name)

    for path, why in [(write("a.gguf", None), "lacks olmo2.feed_forward_length, which a olmo2 file has"),
                      (write("b.gguf", 16), "olmo2.attention.sliding_window is set: an OLMo 3 file, which pagoda "
                                            "does not serve from GGUF")]:
        with pytest.raises(ValueError) as e:
            load_hf_config(path)
        assert str(e.value) == f"{path}: {why}"


@pytest.fixture
def hub(files, tmp_path, monkeypatch):
    """An offline hub cache (HF_HUB_OFFLINE=1) holding the repo pagoda-tests/tiny-GGUF as `hf download` leaves it:
    refs/main naming a snapshot with OLMo 2's Q8_0 and float files, a Q4_0 split into pieces in a folder of its
    own, a projector beside them, and a Q5_0 twice (a second one in a folder). Returns the snapshot."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # as a machine without network
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    ckpt, f32, q8 = files["olmo2"]
    repo = tmp_path / "hub" / "models--pagoda-tests--tiny-GGUF"
    snapshot = repo / "snapshots" / "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(snapshot.name)
    (snapshot / "Q4_0").mkdir(parents=True)
    (snapshot / "other").mkdir()
    write_gguf(ckpt, str(snapshot / "Q4_0" / "tiny-Q4_0.gguf"), types={k: Q.Q4_0 for k in Q8_0}, split=8)
    for name, file in [("tiny-Q8_0.gguf", q8), ("tiny-F32.gguf", f32), ("mmproj-tiny-Q8_0.gguf", f32),
                       ("tiny-Q5_0.gguf", q8), ("other/tiny-instruct-Q5_0.gguf", q8)]:
        os.link(file, snapshot / name)
    return snapshot


def test_a_gguf_named_by_its_hub_repo_and_quant(files, hub):
    """REPO:QUANT (llama.cpp's -hf form; the quant in any case, the projector never), REPO/FILE.gguf; every piece
    of a split file; read from the local hub cache offline."""
    ckpt, _, q8 = files["olmo2"]
    assert resolve_model_path("pagoda-tests/tiny-GGUF:Q8_0") == str(hub / "tiny-Q8_0.gguf")
    assert resolve_model_path("pagoda-tests/tiny-GGUF:f32") == str(hub / "tiny-F32.gguf")
    pieces = sorted(os.listdir(hub / "Q4_0"))
    assert len(pieces) > 1 and resolve_model_path("pagoda-tests/tiny-GGUF:Q4_0") == str(hub / "Q4_0" / pieces[0])
    assert resolve_model_path(f"pagoda-tests/tiny-GGUF/Q4_0/{pieces[0]}") == str(hub / "Q4_0" / pieces[0])
    _same(_greedy("pagoda-tests/tiny-GGUF:Q8_0"), _reference(ckpt, dequantized_state(q8, load_hf_config(q8))))


def test_a_bare_repo_of_gguf_files_serves_its_q4_k_m(files, hub):
    """A hub id alone, for a repo of GGUF files (no config.json): its Q4_K_M as llama.cpp's -hf picks it; without one,
    a one-line error listing the files."""
    with pytest.raises(ValueError) as e:
        resolve_model_path("pagoda-tests/tiny-GGUF")
    assert str(e.value).startswith("model 'pagoda-tests/tiny-GGUF' is a Hugging Face repo of GGUF files, not a "
                                   "checkpoint, and has no Q4_K_M: name one as pagoda-tests/tiny-GGUF:QUANT or "
                                   "pagoda-tests/tiny-GGUF/FILE.gguf (its GGUF files: Q4_0/tiny-Q4_0-00001-of-0000")
    os.link(hub / "tiny-Q8_0.gguf", hub / "tiny-Q4_K_M.gguf")
    assert resolve_model_path("pagoda-tests/tiny-GGUF") == str(hub / "tiny-Q4_K_M.gguf")


@pytest.mark.parametrize("model,message", [
    ("pagoda-tests/tiny-GGUF:Q6_K", "model 'pagoda-tests/tiny-GGUF:Q6_K': of the GGUF files in the Hugging Face "
                                    "repo pagoda-tests/tiny-GGUF, none is of quant Q6_K (its GGUF files: "
                                    "Q4_0/tiny-Q4_0-00001-of-0000"),
    ("pagoda-tests/tiny-GGUF:Q5_0", "model 'pagoda-tests/tiny-GGUF:Q5_0': of the GGUF files in the Hugging Face "
                                    "repo pagoda-tests/tiny-GGUF, several match (other/tiny-instruct-Q5_0.gguf, "
                                    "tiny-Q5_0.gguf): name one as pagoda-tests/tiny-GGUF/FILE.gguf"),
    ("pagoda-tests/no-such-GGUF:Q8_0", "model 'pagoda-tests/no-such-GGUF:Q8_0' is not a local file, and the "
                                       "Hugging Face hub cannot be reached and the model is not in the local cache: "
                                       "download it where there is network (`hf download pagoda-tests/no-such-GGUF "
                                       "--include '*Q8_0*'`"),
    ("pagoda-tests/tiny-GGUF/nope.gguf", "model 'pagoda-tests/tiny-GGUF/nope.gguf' (pagoda-tests/tiny-GGUF: "
                                         "nope.gguf) is not a local file, and the Hugging Face hub cannot be "
                                         "reached and the model is not in the local cache"),
])
def test_a_hub_gguf_that_is_not_there_or_not_one_is_refused_in_one_line(hub, model, message):
    with pytest.raises(ValueError) as e:
        LLM(**vars(engine_config(model)))
    assert str(e.value).startswith(message) and "\n" not in str(e.value), e.value
