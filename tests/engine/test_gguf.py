"""GGUF checkpoints (engine/gguf.py): found as a file, a directory, split pieces or an Ollama store's blob;
config, tokenizer and chat template from the metadata; weights mapped to pagoda's parameters (a llama's
permuted Q/K rows put back), kernel block types kept as blocks, other types widened with one log line.
Greedy output against transformers over the same weights as gguf.quants dequantizes them (and, for one
file, transformers loading the file itself). Bad files are refused in one line naming the file."""
import hashlib
import json
import logging
import os
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf_fixtures import engine_greedy, transformers_greedy, dequantized_state, write_gguf
from grpc_fixtures import engine_config
from pagoda.engine import LLM, SamplingParams
from pagoda.engine.executor.parallel import Linear
from pagoda.engine.gguf import GGUFWeight
from pagoda.engine.layers import quantization as qz
from pagoda.engine.loader import load_hf_config, load_tokenizer, resolve_model_path

pytestmark = pytest.mark.timeout(300)

# Q4_K_M's layout (llama.cpp's llama_tensor_get_type): Q4_K, with attn_v / ffn_down / output in Q6_K; a Q5_K
# piece beside them; the embedding in Q8_0 blocks too (its rows dequantized as looked up)
Q4_K_M = {"attn_q": Q.Q4_K, "attn_k": Q.Q4_K, "attn_v": Q.Q6_K, "attn_output": Q.Q5_K, "ffn_gate": Q.Q4_K,
          "ffn_up": Q.Q4_K, "ffn_down": Q.Q6_K, "output": Q.Q6_K, "token_embd": Q.Q8_0}
# gguf.quants' own quantizers (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1), and a rarer type (IQ2_XXS) widened at load
LEGACY = {"attn_q": Q.Q8_0, "attn_k": Q.Q5_0, "attn_v": Q.Q5_1, "attn_output": Q.Q4_0, "ffn_gate": Q.Q4_1,
          "ffn_up": Q.IQ2_XXS, "ffn_down": Q.Q8_0, "token_embd": Q.Q8_0}
# the low-bit files' types (llama.cpp's Q2_K, Q3_K_S/M/L and IQ4_XS mixes), the embedding and untied head too
LOW_BITS = {"attn_q": Q.Q2_K, "attn_k": Q.Q2_K, "attn_v": Q.Q3_K, "attn_output": Q.IQ4_XS, "ffn_gate": Q.Q3_K,
            "ffn_up": Q.Q2_K, "ffn_down": Q.IQ4_XS, "output": Q.IQ4_XS, "token_embd": Q.Q3_K}
GPT2 = {"attn_qkv": Q.Q4_K, "attn_output": Q.Q8_0, "ffn_up": Q.Q6_K, "ffn_down": Q.Q5_K, "token_embd": Q.Q8_0}
PROMPT = list(range(7, 7 + qz.DEQUANT_MIN_ROWS + 12))  # a prefill over dequantized chunks, then kernel decodes


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Tiny transformers checkpoints whose linear layers take 256-weight super-blocks (qwen2's LM head tied to
    its embedding, as Qwen2.5-0.5B's)."""
    from pagoda.engine.demo import build_tiny_checkpoint

    root = tmp_path_factory.mktemp("gguf")
    ckpts = {arch: build_tiny_checkpoint(str(root / arch), arch=arch, hidden_size=256, intermediate_size=512,
                                         initializer_range=0.3, tie_word_embeddings=arch == "qwen2")
             for arch in ("llama", "qwen2", "qwen3", "mistral")}
    ckpts["gpt2"] = build_tiny_checkpoint(str(root / "gpt2"), arch="gpt2", n_embd=256, initializer_range=0.3)
    return ckpts


def _greedy(model: str, n: int = 12) -> tuple[list[int], torch.nn.Module]:
    return engine_greedy(model, PROMPT, n)


def _reference(ckpt: str, state=None, n: int = 12) -> list[int]:
    return transformers_greedy(ckpt, PROMPT, n, state)


@pytest.mark.parametrize("arch,float_type", [("llama", Q.F32), ("qwen3", Q.F16), ("mistral", Q.BF16), ("gpt2", Q.F32)])
def test_float_file_is_token_identical_to_transformers(checkpoints, tmp_path, arch, float_type):
    path = write_gguf(checkpoints[arch], str(tmp_path / f"{arch}.gguf"), float_type=float_type)
    got, model = _greedy(path)
    state = None if float_type == Q.F32 else dequantized_state(path, load_hf_config(path))
    assert got == _reference(checkpoints[arch], state)
    assert not any(isinstance(m.qweight, GGUFWeight) for m in model.modules() if isinstance(m, Linear))


@pytest.mark.parametrize("arch,types", [("llama", Q4_K_M), ("qwen2", LEGACY), ("gpt2", GPT2)],
                         ids=["llama-Q4_K_M", "qwen2-Q8_0", "gpt2"])
def test_block_types_match_transformers_on_the_dequantized_weights(checkpoints, tmp_path, caplog, arch, types):
    path = write_gguf(checkpoints[arch], str(tmp_path / f"{arch}.gguf"), types=types)
    with caplog.at_level(logging.INFO, logger="pagoda.engine"):
        got, model = _greedy(path)
    widened = [r.getMessage() for r in caplog.records if "widened" in r.getMessage()]
    if arch == "qwen2":  # the one log line naming them
        assert len(widened) == 1 and widened[0].endswith("IQ2_XXS: blk.0.ffn_up.weight, blk.1.ffn_up.weight"), widened
    else:
        assert not widened
    embedding = model.wte if arch == "gpt2" else model.embed_tokens
    assert embedding.weight is None and embedding.qweight.parts[0][0] == "Q8_0"
    assert (model.lm_head.qweight is embedding.qweight) == (arch != "llama")  # a tied head: the same blocks
    layers = [m for m in model.modules() if isinstance(m, Linear) and m.qweight is not None]
    assert all(m.weight is None for m in layers)
    kinds = {k for m in layers for k, _ in m.qweight.parts}
    # qwen2's gate_up: gate in Q4_1 blocks, up widened (IQ2_XXS) beside it as a float part
    assert kinds == {"llama": {"Q4_K", "Q5_K", "Q6_K"}, "qwen2": {"Q8_0", "Q5_0", "Q5_1", "Q4_0", "Q4_1", None},
                     "gpt2": {"Q4_K", "Q5_K", "Q6_K", "Q8_0"}}[arch]
    if arch == "llama":  # qkv: q and k in Q4_K, v in Q6_K, side by side in one layer
        assert [k for k, _ in model.layers[0].self_attn.qkv_proj.qweight.parts] == ["Q4_K", "Q6_K"]
    want = _reference(checkpoints[arch], dequantized_state(path, load_hf_config(path)))
    same = sum(a == b for a, b in zip(got, want))
    assert got[0] == want[0] and same >= 0.9 * len(want), (got, want)  # float32 activations: all, so far


def test_low_bit_block_types_stay_blocks_and_match_transformers(checkpoints, tmp_path, caplog):
    """Q2_K, Q3_K and IQ4_XS are computed on as blocks (no widening log line), the embedding's rows and the
    head included; greedy output token-identical to transformers over gguf.quants' dequantized weights."""
    path = write_gguf(checkpoints["llama"], str(tmp_path / "low.gguf"), types=LOW_BITS)
    with caplog.at_level(logging.INFO, logger="pagoda.engine"):
        got, model = _greedy(path)
    assert not [r.getMessage() for r in caplog.records if "widened" in r.getMessage()]
    assert model.embed_tokens.weight is None and model.embed_tokens.qweight.parts[0][0] == "Q3_K"
    assert model.lm_head.qweight.parts[0][0] == "IQ4_XS"
    layers = [m for m in model.modules() if isinstance(m, Linear) and m.qweight is not None]
    assert all(m.weight is None for m in layers)
    assert {k for m in layers for k, _ in m.qweight.parts} == {"Q2_K", "Q3_K", "IQ4_XS"}
    assert [k for k, _ in model.layers[0].self_attn.qkv_proj.qweight.parts] == ["Q2_K", "Q3_K"]
    assert got == _reference(checkpoints["llama"], dequantized_state(path, load_hf_config(path)))


def test_llama3_rope_scaling_from_rope_freqs(tmp_path):
    """Llama 3.1+ files keep their RoPE scaling only as per-frequency factors (rope_freqs.weight): read back as
    transformers' llama3 rope_parameters."""
    from pagoda.engine.demo import build_tiny_checkpoint

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    ckpt = build_tiny_checkpoint(str(tmp_path / "llama3"), hidden_size=256, intermediate_size=512,
                                 initializer_range=0.3, rope_parameters=rope, max_position_embeddings=8256)
    path = write_gguf(ckpt, str(tmp_path / "m.gguf"), types=Q4_K_M)
    assert load_hf_config(path).rope_parameters == rope
    assert _greedy(path)[0] == _reference(ckpt, dequantized_state(path, load_hf_config(path)))


def test_without_the_cpu_kernels_every_block_type_is_widened(checkpoints, tmp_path, caplog, monkeypatch):
    """Where pagoda's CPU ops cannot run (a GPU, no compiler) the blocks are widened, in one log line."""
    from pagoda.engine.layers import cpu_ops

    path = write_gguf(checkpoints["llama"], str(tmp_path / "m.gguf"), types=Q4_K_M)
    quantized, _ = _greedy(path)
    monkeypatch.setattr(cpu_ops, "is_available", lambda device: (False, "no C++ compiler"))
    with caplog.at_level(logging.INFO, logger="pagoda.engine"):
        widened, model = _greedy(path)
    assert widened == quantized
    assert not any(getattr(m, "qweight", None) is not None for m in model.modules())
    lines = [r.getMessage() for r in caplog.records if "widened" in r.getMessage()]
    assert len(lines) == 1 and "(not on pagoda's CPU ops: no C++ compiler): " in lines[0], lines
    assert "Q8_0: token_embd.weight" in lines[0] and "blk.1.attn_q.weight" in lines[0]


@pytest.mark.parametrize("arch,types", [("llama", Q4_K_M), ("qwen2", LEGACY)], ids=["llama-Q4_K_M", "qwen2-Q8_0"])
def test_two_ranks_agree_with_one(checkpoints, tmp_path, caplog, arch, types):
    """Each rank keeps its rows, or its columns in whole blocks: llama's o_proj (256 inputs, 128 a rank) splits
    its Q5_K super-blocks, so it is widened there, in the log line; the rest stays in blocks. Two ranks' sums
    come in another order than one's: tokens within float32 rounding of each other."""
    path = write_gguf(checkpoints[arch], str(tmp_path / "m.gguf"), types=types)
    runs = []
    for tp in (1, 2):
        with caplog.at_level(logging.INFO, logger="pagoda.engine"):
            llm = LLM(**vars(engine_config(path, tensor_parallel_size=tp, num_kv_blocks=32,
                                           max_num_batched_tokens=128)))
        try:
            out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
            runs.append(list(out.outputs[0].token_ids))
            if tp == 2:
                layers = [m for m in llm.engine.model.modules() if isinstance(m, Linear) and m.qweight is not None]
                assert len(layers) >= 5 and not any(isinstance(m.qweight, GGUFWeight) and m.weight is not None
                                                    for m in layers)
        finally:
            llm.engine.close()
    assert runs[0][0] == runs[1][0] and sum(a == b for a, b in zip(*runs)) >= 0.9 * len(runs[0]), runs
    if arch == "llama":
        assert any("Q5_K: blk.0.attn_output.weight, blk.1.attn_output.weight" in r.getMessage() for r in caplog.records)


def test_transformers_loading_the_file_itself_agrees(checkpoints, tmp_path):
    """The oracle above (gguf.quants dequantize, Q/K unpermuted) is what transformers' own GGUF loader does."""
    from transformers import AutoModelForCausalLM

    path = write_gguf(checkpoints["llama"], str(tmp_path / "m.gguf"), types=Q4_K_M)
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="m.gguf", dtype=torch.float32)
    out = model.generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False, eos_token_id=None)
    assert out[0, len(PROMPT):].tolist() == _reference(checkpoints["llama"], dequantized_state(
        path, load_hf_config(path)))


def test_split_files_and_a_directory_holding_them(checkpoints, tmp_path):
    one = write_gguf(checkpoints["qwen2"], str(tmp_path / "one.gguf"), types=LEGACY)
    pieces = tmp_path / "split"
    pieces.mkdir()
    write_gguf(checkpoints["qwen2"], str(pieces / "m.gguf"), types=LEGACY, split=8)
    names = sorted(os.listdir(pieces))
    assert names[0] == "m-00001-of-00004.gguf" and len(names) == 4
    assert resolve_model_path(str(pieces)) == str(pieces / names[0])
    assert _greedy(str(pieces))[0] == _greedy(one)[0]
    os.remove(pieces / names[2])
    with pytest.raises(ValueError, match="split GGUF lacks m-00003-of-00004.gguf"):
        _greedy(str(pieces))
    (tmp_path / "two").mkdir()
    for name in ("a.gguf", "b.gguf"):
        os.link(one, tmp_path / "two" / name)
    with pytest.raises(ValueError, match=r"holds several GGUF files \(a.gguf, b.gguf\)"):
        resolve_model_path(str(tmp_path / "two"))


def test_a_model_in_the_ollama_store(checkpoints, tmp_path, monkeypatch):
    """A store as `ollama pull` leaves it: a manifest naming the model layer's digest, the blob under it,
    read where it lies ($OLLAMA_MODELS read when the model is resolved)."""
    path = write_gguf(checkpoints["llama"], str(tmp_path / "m.gguf"), types=Q4_K_M)
    store = tmp_path / "ollama"
    digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    (store / "blobs").mkdir(parents=True)
    os.link(path, store / "blobs" / f"sha256-{digest}")
    manifest = store / "manifests" / "registry.ollama.ai" / "library" / "tiny"
    manifest.mkdir(parents=True)
    layers = [{"mediaType": "application/vnd.ollama.image.template", "digest": "sha256-0", "size": 1},
              {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}", "size": 1}]
    (manifest / "q4").write_text(json.dumps({"schemaVersion": 2, "layers": layers}))
    monkeypatch.setenv("OLLAMA_MODELS", str(store))
    blob = str(store / "blobs" / f"sha256-{digest}")
    assert resolve_model_path("ollama:tiny:q4") == blob
    assert _greedy("ollama:tiny:q4")[0] == _greedy(path)[0]
    with pytest.raises(ValueError, match=r"'ollama:tiny': no such model in the Ollama store .*ollama pull tiny"):
        resolve_model_path("ollama:tiny")  # tag latest: not pulled


def test_tokenizer_chat_template_and_config_from_the_metadata(checkpoints, tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    ckpt = checkpoints["qwen3"]
    path = write_gguf(ckpt, str(tmp_path / "m.gguf"))
    tok, want = load_tokenizer(path), AutoTokenizer.from_pretrained(ckpt)
    text = "héllo <|eos|> wörld\n"
    assert tok.encode(text) == want.encode(text) and tok.decode(tok.encode(text)) == text
    chat = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(chat, tokenize=False) == want.apply_chat_template(chat, tokenize=False)
    cfg, ref = load_hf_config(path), AutoConfig.from_pretrained(ckpt)
    assert cfg.architectures == ["Qwen3ForCausalLM"] and cfg.gguf == {"file": path, "types": ["F32"]}
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "vocab_size", "eos_token_id", "bos_token_id", "tie_word_embeddings"):
        assert getattr(cfg, key) == getattr(ref, key), key
    assert cfg.rms_norm_eps == pytest.approx(ref.rms_norm_eps, rel=1e-6)  # metadata floats are float32
    assert load_tokenizer(path, chat_template="{{ 'x' }}").chat_template == "{{ 'x' }}"


def test_bad_files_are_refused_in_one_line_naming_the_file(checkpoints, tmp_path):
    import gguf

    path = write_gguf(checkpoints["llama"], str(tmp_path / "m.gguf"), types=Q4_K_M)
    data = Path(path).read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:len(data) // 2])
    not_gguf = tmp_path / "x.gguf"
    not_gguf.write_bytes(b"PK\x03\x04" + data[4:64])
    bert = tmp_path / "bert.gguf"
    w = gguf.GGUFWriter(str(bert), "bert")
    w.add_block_count(1)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    for model, why in [(cut, "is not a readable GGUF file"), (not_gguf, "is not a GGUF file"),
                       (bert, "general.architecture 'bert' is not one pagoda serves from GGUF")]:
        with pytest.raises(ValueError, match=why) as e:
            LLM(**vars(engine_config(str(model))))
        assert str(model) in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"deterministic mode: .*m.gguf holds Q4_K, Q5_K, Q6_K, Q8_0 blocks, which "
                                         r"have no batch-invariant kernel yet"):
        LLM(**vars(engine_config(path, deterministic=True)))


def test_a_tokenizer_directory_replaces_the_checkpoints_own(checkpoints, tmp_path):
    """--tokenizer DIR: its tokenizer and chat template instead of a GGUF's embedded ones (or a safetensors
    checkpoint's); a directory that is not there, or holds no tokenizer, refused in one line naming tokenizer."""
    from transformers import AutoTokenizer
    from pagoda.client.cli import build_parser
    from pagoda.server.main import engine_config as serve_config

    tok = AutoTokenizer.from_pretrained(checkpoints["qwen3"])
    tok.chat_template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    tok.save_pretrained(str(tmp_path / "tok"))
    path = write_gguf(checkpoints["qwen3"], str(tmp_path / "m.gguf"))
    args = build_parser().parse_args(["serve", path, "--tokenizer", str(tmp_path / "tok")])
    assert serve_config(args).tokenizer == str(tmp_path / "tok")
    chat = [{"role": "user", "content": "hi"}]
    for model in (path, checkpoints["qwen3"]):
        llm = LLM(**vars(engine_config(model, tokenizer=str(tmp_path / "tok"), num_kv_blocks=16)))
        try:
            assert llm.tokenizer.apply_chat_template(chat, tokenize=False) == "[hi]"
            out = llm.chat(chat, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))[0]
            assert out.prompt_token_ids == tok.encode("[hi]", add_special_tokens=False)
        finally:
            llm.engine.close()
    for tokenizer, why in [(tmp_path / "nope", "no such directory"), (tmp_path, "has no tokenizer files")]:
        with pytest.raises(ValueError, match=why) as e:
            LLM(**vars(engine_config(path, tokenizer=str(tokenizer))))
        assert str(e.value).startswith(f"tokenizer '{tokenizer}'") and "\n" not in str(e.value), e.value


def test_the_file_type_size_and_parameters_reported(checkpoints, tmp_path):
    """What the weights are: llama.cpp's file type (general.file_type; without it, the type most matrices are
    in), the file's bytes (every piece of a split one), the parameters it stores."""
    from gguf import GGUFReader
    from pagoda.engine.loader import checkpoint_weights

    path = write_gguf(checkpoints["llama"], str(tmp_path / "m.gguf"), types=Q4_K_M, file_type=15)
    llm = LLM(**vars(engine_config(path, num_kv_blocks=16)))
    try:
        info = llm.engine.model_info()
    finally:
        llm.engine.close()
    parameters = sum(int(t.n_elements) for t in GGUFReader(path).tensors)
    assert (info.quantization, info.weights_format, info.weights_path, info.weights_bytes, info.num_parameters) == (
        "Q4_K_M", "gguf", path, os.path.getsize(path), parameters)
    guessed = write_gguf(checkpoints["llama"], str(tmp_path / "g.gguf"), types=Q4_K_M, file_type=None)
    assert checkpoint_weights(guessed)["quantization"] == "Q4_K"  # 8 of its 16 matrices
    (tmp_path / "split").mkdir()
    write_gguf(checkpoints["llama"], str(tmp_path / "split" / "m.gguf"), types=LEGACY, split=8, file_type=7)
    pieces = sorted((tmp_path / "split").iterdir())
    split = checkpoint_weights(str(pieces[0]))
    assert split["quantization"] == "Q8_0" and split["weights_bytes"] == sum(p.stat().st_size for p in pieces)
    assert checkpoint_weights(write_gguf(checkpoints["llama"], str(tmp_path / "f.gguf"),
                                         file_type=1))["quantization"] == ""  # F16: weights in dtype
    safetensors = checkpoint_weights(checkpoints["llama"])
    assert safetensors["weights_format"] == "safetensors" and safetensors["quantization"] == ""
    assert safetensors["weights_bytes"] == os.path.getsize(os.path.join(checkpoints["llama"], "model.safetensors"))


def test_the_doors_report_the_file(checkpoints, tmp_path):
    """GetModelInfo, /v1/models and Ollama's /api/tags and /api/show (through the `ollama` client) say what the
    GGUF is: its file type as the quantization, its size and parameters."""
    import ollama
    from grpc_fixtures import InProcessServer, openai_client
    from pagoda.client.client import Client
    from pagoda.server.options import ServerOptions

    path = write_gguf(checkpoints["llama"], str(tmp_path / "m.gguf"), types=Q4_K_M, file_type=15)
    srv = InProcessServer.for_config(engine_config(path, num_kv_blocks=16),
                                     ServerOptions(http_port=0, served_model_names=("m",))).wait_ready()
    try:
        with Client(srv.target, timeout=60) as c:
            info = c.model_info()
        assert (info.quantization, info.weights_format, info.weights_path, info.weights_bytes) == (
            "Q4_K_M", "gguf", path, os.path.getsize(path))
        assert openai_client(srv).models.list().data[0].model_extra["quantization"] == "Q4_K_M"
        client = ollama.Client(host=srv.http_url, timeout=60)
        (listed,) = client.list().models
        assert listed.size == os.path.getsize(path) and listed.details.quantization_level == "Q4_K_M"
        assert listed.details.format == "gguf" and listed.details.parameter_size.endswith("M")
        shown = client.show("m")
        assert shown.details.quantization_level == "Q4_K_M"
        assert shown.modelinfo["general.parameter_count"] == srv.engine.model_info.num_parameters > 0
    finally:
        srv.stop()
