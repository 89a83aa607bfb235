"""Weight-only int8 (`quantization="int8"`, CPU): the layers hold int8 weights and scales, both matmul
paths (torch's int8 kernel for few rows, dequantized chunks beyond) equal a float matmul over the
dequantized weights, and an engine's log-probabilities stay within bfloat16 rounding of transformers
run on those same dequantized weights, for every layer kind (fused QKV with bias, GPT-2's Conv1D,
a tied head). Refusals name the option."""
import copy

import pytest
import torch
import torch.nn.functional as F

from grpc_fixtures import InProcessServer, engine_config, tiny_checkpoint
from pagoda.client.client import Client
from pagoda.engine import LLM, EngineConfig, SamplingParams
from pagoda.engine.layers import quantization as qz
from pagoda.engine.executor.parallel import Linear

pytestmark = pytest.mark.timeout(300)


def test_quantize_int8_rounds_each_row_to_its_own_scale():
    rows = 2 * qz.CHUNK_ROWS + 40  # quantized a chunk of rows at a time
    w = torch.randn(rows, 64) * torch.logspace(-3, 1, rows)[:, None]  # rows of very different magnitude
    q, scales = qz.quantize_int8(w)
    assert q.dtype == torch.int8 and scales.dtype == torch.bfloat16 and scales.shape == (rows,)
    assert q.abs().amax(dim=1).ge(126).all()  # every row uses its range
    err = (q.float() * scales.float()[:, None] - w).abs()
    assert (err <= scales.float()[:, None] * 0.51 + w.abs() * 2 ** -8).all()  # half a step (+ bf16 scale)


@pytest.mark.parametrize("rows", [1, 5, qz.DEQUANT_MIN_ROWS - 1, qz.DEQUANT_MIN_ROWS, 130])
@pytest.mark.parametrize("gemm_dtype", [torch.bfloat16, torch.float32])
def test_int8_linear_equals_a_float_matmul_of_the_dequantized_weight(rows, gemm_dtype):
    torch.manual_seed(0)
    layer = Linear(96, 2 * qz.CHUNK_ROWS + 40, bias=True)  # several dequantized chunks, a partial one
    x = torch.randn(rows, 96)
    ref_w = copy.deepcopy(layer)
    assert qz.quantize_model_(layer, "int8", Linear) == 1 and layer.weight is None
    layer.gemm_dtype = gemm_dtype
    ref = F.linear(x, layer.qweight.float() * layer.scales.float()[:, None], ref_w.bias)
    out = layer(x)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert (out - ref).abs().max() <= 0.02 * ref.abs().max()  # bfloat16 activations
    assert torch.equal(layer(x[None])[0], out)  # [batch, rows, in] as well


def test_a_layer_the_kernel_cannot_take_stays_float():
    layer = Linear(24, 8, bias=False)  # the kernel needs input features in multiples of 16
    assert qz.quantize_model_(layer, "int8", Linear) == 0
    assert layer.qweight is None and layer.weight is not None
    x = torch.randn(3, 24)
    assert torch.equal(layer(x), F.linear(x, layer.weight))


def dequantized_reference(path: str):
    """transformers' model of the checkpoint with every linear weight pagoda quantizes replaced by
    its dequantized int8 (embeddings untied and kept in float32, as pagoda keeps them)."""
    from transformers import AutoModelForCausalLM
    from transformers.pytorch_utils import Conv1D

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        head = model.get_output_embeddings()
        head.weight = torch.nn.Parameter(head.weight.detach().clone())  # untie
        for m in model.modules():
            if isinstance(m, torch.nn.Linear) and m.in_features % 16 == 0:
                q, s = qz.quantize_int8(m.weight)
                m.weight.copy_(q.float() * s.float()[:, None])
            elif isinstance(m, Conv1D):  # GPT-2: weight [in, out]
                q, s = qz.quantize_int8(m.weight.t())
                m.weight.copy_((q.float() * s.float()[:, None]).t())
    return model


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_engine_logprobs_match_transformers_on_the_dequantized_weights(arch):
    path = tiny_checkpoint(arch)
    llm = LLM(**vars(engine_config(path, quantization="int8", block_size=4, max_num_batched_tokens=16)))
    linears = [m for m in llm.engine.model.modules() if isinstance(m, Linear)]
    assert linears and all(m.qweight is not None and m.weight is None for m in linears)
    assert llm.engine.model_info().quantization == "int8"

    prompt = list(range(7, 47))
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                prompt_logprobs=0))[0]
    ids = prompt + list(out.outputs[0].token_ids)
    # teacher-forced over prompt and completion alike: the completion's tokens as scored by the engine
    scored = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0))[0].prompt_logprobs[1:]
    with torch.no_grad():
        ref = dequantized_reference(path)(torch.tensor([ids])).logits[0, :-1].log_softmax(-1)
    got = torch.tensor([lp.logprob for lp in scored])
    want = ref.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    diff = (got - want).abs()  # bfloat16 activations: ~0.4% of each layer's output
    assert diff.mean() < 0.05 and diff.max() < 0.3, diff
    # greedy picks: the reference's own argmax after each prompt + completion prefix
    assert ref[len(prompt) - 1:].argmax(-1).tolist() == list(out.outputs[0].token_ids)
    s = llm.engine.block_manager.stats()
    assert s.num_free_blocks == s.num_total_blocks


def test_refusals_name_the_option():
    with pytest.raises(ValueError, match="quantization must be one of int8, int4; got 'int3'"):
        EngineConfig(quantization="int3")
    with pytest.raises(ValueError, match="quantization 'int8' .* runs on CPU only; on cuda use dtype"):
        qz.check("int8", torch.device("cuda"))


def test_served_model_reports_its_quantization():
    srv = InProcessServer.for_config(engine_config(tiny_checkpoint(), quantization="int8")).wait_ready()
    try:
        with Client(srv.target, timeout=60) as c:
            assert c.model_info().quantization == "int8"
            assert c.generate("héllo", max_tokens=8, ignore_eos=True).usage.completion_tokens == 8
    finally:
        srv.stop()


@pytest.mark.parametrize("command", ["serve", "offline"])
def test_cli_flag_names_its_choices(capsys, command):
    from pagoda.client.cli import main
    with pytest.raises(SystemExit) as e:
        main([command, "--quantization", "int3"] + (["hi"] if command == "offline" else []))
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "argument --quantization: invalid choice: 'int3' (choose from" in err and "int8" in err


def test_tensor_parallel_ranks_quantize_their_own_shards():
    """Each rank quantizes what it holds (row-parallel layers: scales over its half of the inputs), so
    two ranks agree with one to within int8's rounding, not bit for bit."""
    path, prompt = tiny_checkpoint("qwen2"), list(range(5, 45))
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, prompt_logprobs=0)
    runs = []
    for tp in (1, 2):
        llm = LLM(**vars(engine_config(path, quantization="int8", tensor_parallel_size=tp)))
        try:
            runs.append(llm.generate([prompt], params)[0])
        finally:
            llm.engine.close()
    one, two = ([lp.logprob for lp in r.prompt_logprobs[1:]] for r in runs)
    assert len(one) == len(prompt) - 1 and max(abs(a - b) for a, b in zip(one, two)) < 0.3
    assert all(len(r.outputs[0].token_ids) == 16 for r in runs)  # (greedy picks may flip at near-ties)


def test_quantize_q4_1_keeps_each_block_within_half_a_step():
    """int4: 32 weights a block, their minimum and step in float16 (GGUF Q4_1, read back by gguf.quants)."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    w = torch.randn(2 * qz.CHUNK_ROWS + 40, 96) * torch.logspace(-3, 1, 2 * qz.CHUNK_ROWS + 40)[:, None]
    blocks = qz.quantize_q4_1(w)
    assert blocks.shape == (w.shape[0], 3 * 20) and blocks.dtype == torch.uint8
    got = torch.from_numpy(dequantize(np.asarray(blocks), GGMLQuantizationType.Q4_1))
    step = (w.view(-1, 3, 32).amax(-1) - w.view(-1, 3, 32).amin(-1)) / 15
    assert ((got - w).view(-1, 3, 32).abs() <= step[..., None] * 0.51 + w.abs().amax() * 2 ** -10).all()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_int4_engine_matches_transformers_on_the_dequantized_weights(arch):
    """Every linear layer (the LM head too) in Q4_1 blocks, computed on by the GGUF kernels with float32
    activations: the engine's greedy tokens and log-probabilities are transformers' over the same weights."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoint(arch)
    llm = LLM(**vars(engine_config(path, quantization="int4", block_size=4, max_num_batched_tokens=64)))
    linears = [m for m in llm.engine.model.modules() if isinstance(m, Linear)]
    assert linears and all(m.weight is None and m.qweight.parts[0][0] == "Q4_1" for m in linears)
    assert llm.engine.model_info().quantization == "int4"
    prompt = list(range(7, 47))
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
    ids = prompt + list(out.outputs[0].token_ids)
    scored = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0))[0].prompt_logprobs[1:]
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        head = ref.get_output_embeddings()
        head.weight = torch.nn.Parameter(head.weight.detach().clone())  # untie: the head alone is quantized
        for m in ref.modules():
            if isinstance(m, torch.nn.Linear):
                blocks = np.asarray(qz.quantize_q4_1(m.weight))
                m.weight.copy_(torch.from_numpy(dequantize(blocks, GGMLQuantizationType.Q4_1)))
        logits = ref(torch.tensor([ids])).logits[0, :-1].log_softmax(-1)
    assert logits[len(prompt) - 1:].argmax(-1).tolist() == list(out.outputs[0].token_ids)
    want = logits.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert (torch.tensor([lp.logprob for lp in scored]) - want).abs().max() < 1e-3
