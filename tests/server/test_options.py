"""Bad options raise errors that name the option."""
import json
import os

import pytest

from pagoda.engine import LLM, EngineConfig, SamplingParams
from pagoda.engine.errors import InvalidRequestError


@pytest.mark.parametrize("option,value", [("block_size", 0), ("block_size", 12), ("max_num_seqs", 0),
                                          ("max_num_batched_tokens", -1), ("num_kv_blocks", 0),
                                          ("dtype", "float64"), ("attention_backend", "cuda"),
                                          ("gpu_memory_utilization", 1.5), ("max_model_len", 0),
                                          ("enforce_eager", "yes"), ("enable_prefix_caching", 1),
                                          ("cpu_threads", 0), ("cpu_threads", 1.5), ("cpu_linear", "blas")])
def test_bad_engine_option_names_it(option, value):
    with pytest.raises(ValueError, match=option):
        EngineConfig(**{option: value})


def test_serve_leaves_a_core_to_the_front_end(monkeypatch):
    # `pagoda serve`'s engine on CPU: --cpu-threads / PAGODA_CPU_THREADS, by default a core less than
    # the process may use (so that gRPC's work does not preempt an OpenMP thread of every operator)
    import pagoda.server.main
    from pagoda.client.cli import build_parser
    from pagoda.server.main import engine_config

    monkeypatch.delenv("PAGODA_CPU_THREADS", raising=False)
    monkeypatch.setattr(pagoda.server.main, "_cpu_quota", lambda root: None)  # whatever this machine's cgroup says
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert engine_config(build_parser().parse_args(["serve"])).cpu_threads == 3
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {5})
    assert engine_config(build_parser().parse_args(["serve"])).cpu_threads == 1
    assert engine_config(build_parser().parse_args(["serve", "--cpu-threads", "2"])).cpu_threads == 2
    monkeypatch.setenv("PAGODA_CPU_THREADS", "5")
    assert engine_config(build_parser().parse_args(["serve"])).cpu_threads == 5


def test_usable_cores_honours_a_cgroup_quota(tmp_path, monkeypatch):
    from pagoda.server.main import usable_cores

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    assert usable_cores(str(tmp_path)) == 16  # no cgroup files: the affinity mask
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert usable_cores(str(tmp_path)) == 16
    (tmp_path / "cpu.max").write_text("250000 100000\n")  # docker --cpus 2.5
    assert usable_cores(str(tmp_path)) == 3
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("100000\n")  # cgroup v1, one CPU
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert usable_cores(str(tmp_path)) == 1


def test_cpu_threads_set_torch_threads(checkpoint):
    import torch

    before = torch.get_num_threads()
    want = 1 if before != 1 else 2
    try:
        LLM(checkpoint("llama"), num_kv_blocks=8, cpu_threads=want)
        assert torch.get_num_threads() == want
    finally:
        torch.set_num_threads(before)


def test_unknown_llm_option():
    with pytest.raises(TypeError, match="block_sise"):
        LLM(None, block_sise=16)


def test_unknown_architecture(tmp_path, checkpoint):
    src = checkpoint("llama")
    for name in os.listdir(src):
        (tmp_path / name).write_bytes(open(os.path.join(src, name), "rb").read())
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["architectures"] = ["FalconForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="architecture"):
        LLM(str(tmp_path), num_kv_blocks=8)


def test_pickle_only_checkpoint_refused(tmp_path, checkpoint):
    src = checkpoint("llama")
    for name in os.listdir(src):
        if not name.endswith(".safetensors"):
            (tmp_path / name).write_bytes(open(os.path.join(src, name), "rb").read())
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ValueError, match="safetensors"):
        LLM(str(tmp_path), num_kv_blocks=8)


CHECKPOINT_FILES = ("a checkpoint directory holds config.json, the tokenizer files and *.safetensors weights "
                    "(e.g. `hf download Qwen/Qwen3-0.6B --local-dir DIR`)")


@pytest.mark.parametrize("model,message", [
    ("/nonexistent/model", "model '/nonexistent/model': no such directory (a local checkpoint directory, or a "
                           "Hugging Face hub id such as Qwen/Qwen3-0.6B)"),
    ("./no/such/dir", "model './no/such/dir': no such directory"),
    ("{empty}", f"model '{{empty}}' has no config.json: {CHECKPOINT_FILES}"),
    ("{config_only}", f"model '{{config_only}}' has no tokenizer files (tokenizer.json, tokenizer.model, "
                      f"vocab.json, *.tiktoken): {CHECKPOINT_FILES}"),
    ("{no_weights}", f"model '{{no_weights}}' has no *.safetensors weights: {CHECKPOINT_FILES}"),
    ("pagoda-tests/no-such-model", "model 'pagoda-tests/no-such-model' is not a local directory, and the Hugging "
                                   "Face hub cannot be reached and the model is not in the local cache: download it "
                                   "where there is network (`hf download pagoda-tests/no-such-model`"),
])
def test_a_missing_checkpoint_says_what_is_missing(tmp_path, monkeypatch, model, message):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # as a machine without network
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    (tmp_path / "empty").mkdir()
    (tmp_path / "config_only").mkdir()
    (tmp_path / "config_only" / "config.json").write_text("{}")
    (tmp_path / "no_weights").mkdir()
    (tmp_path / "no_weights" / "config.json").write_text("{}")
    (tmp_path / "no_weights" / "tokenizer.json").write_text("{}")

    def fill(text: str) -> str:
        for name in ("empty", "config_only", "no_weights"):
            text = text.replace("{" + name + "}", str(tmp_path / name))
        return text

    with pytest.raises(ValueError) as e:
        LLM(fill(model), num_kv_blocks=8)
    assert str(e.value).startswith(fill(message)) and "\n" not in str(e.value), e.value


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(checkpoint("llama"), num_kv_blocks=16, max_model_len=64)


def test_request_errors_name_the_field(llm):
    with pytest.raises(InvalidRequestError, match="prompt"):
        llm.generate([""], SamplingParams())
    with pytest.raises(InvalidRequestError, match="prompt"):
        llm.generate([[1, 10**6]], SamplingParams())
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        llm.generate([[1] * 60], SamplingParams(max_tokens=10))
    with pytest.raises(InvalidRequestError, match="prompt"):
        llm.generate([[1] * 64], SamplingParams(max_tokens=None))
    with pytest.raises(InvalidRequestError, match="stop_token_ids"):
        llm.generate([[1]], SamplingParams(stop_token_ids=[10**6]))
    # nothing leaked, and the engine still works
    assert llm.engine.stats().num_free_blocks == 16
    assert llm.generate([[1, 2]], SamplingParams(max_tokens=3, ignore_eos=True))[0].num_generated_tokens == 3


# A lone UTF-16 surrogate: what JSON's unpaired "\ud800" escape decodes to, and what a byte that is not
# UTF-8 on a command line becomes (surrogateescape); no tokenizer or grammar takes it.
LONE = "a\ud800b"


@pytest.mark.parametrize("kw,field", [
    (dict(stop=["ok", LONE]), "stop[1]"), (dict(bad_words=[LONE]), "bad_words[0]"),
    (dict(structured_outputs={"regex": LONE}), "structured_outputs.regex"),
    (dict(structured_outputs={"grammar": f'start: "{LONE}"'}), "structured_outputs.grammar"),
    (dict(structured_outputs={"choice": ["a", "\udcff"]}), "structured_outputs.choice[1]"),
    (dict(structured_outputs={"json": {"type": "object", "properties": {LONE: {"type": "string"}}}}),
     "structured_outputs.json"),
    (dict(structured_outputs={"json": '{"enum": ["\ud800"]}'}), "structured_outputs.json"),
])
def test_a_lone_surrogate_in_an_option_names_it(kw, field):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kw)
    assert e.value.field == field and "lone surrogate" in e.value.message, e.value


def test_a_lone_surrogate_in_a_request_names_it(llm):
    from pagoda.engine.inputs import make_request
    from pagoda.engine.validation import check_messages

    with pytest.raises(InvalidRequestError) as e:
        llm.generate(["fine", LONE], SamplingParams())
    assert e.value.field == "prompt" and "lone surrogate '\\ud800' at character 1" in e.value.message
    with pytest.raises(InvalidRequestError) as e:
        make_request("hi", None, model=llm._model, tokenizer=llm.tokenizer, request_id=LONE)
    assert e.value.field == "request_id"
    # a JSON escape in a schema given as text (as gRPC carries it) is decoded when it compiles
    params = SamplingParams(structured_outputs={"json": '{"properties": {"\\ud800": {"type": "string"}}}'})
    with pytest.raises(InvalidRequestError) as e:
        llm.generate(["hi"], params)
    assert e.value.field == "structured_outputs.json" and "lone surrogate" in e.value.message
    with pytest.raises(InvalidRequestError) as e:  # what the chat template is handed (AsyncEngine)
        check_messages([{"role": "user", "content": "hi"}, {"role": "user", "content": LONE}])
    assert e.value.field == "messages[1].content"
    assert llm.engine.stats().num_free_blocks == 16


def test_max_model_len_beyond_cache_is_refused(checkpoint):
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(checkpoint("llama"), num_kv_blocks=2, block_size=16, max_model_len=100)


def test_default_max_tokens_fills_context_and_stop_strings(llm):
    out = llm.generate([[1] * 60], SamplingParams(max_tokens=None, ignore_eos=True))[0]
    assert out.num_generated_tokens == 4 and out.finish_reason == "length"
    text = llm.generate(["ab"], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0].text
    stop = text[3:5]
    if stop and "\ufffd" not in stop:
        cut = llm.generate(["ab"], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]))[0]
        assert cut.stop_reason == "stop_string" and cut.text == text[:text.index(stop)]


def test_vllm_prompt_dicts(checkpoint):
    llm = LLM(checkpoint("llama"), num_kv_blocks=16)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    text, ids = "héllo wörld", [5, 9, 200, 14]
    plain = llm.generate([text, ids], params)
    dicts = llm.generate([{"prompt": text}, {"prompt_token_ids": ids}], params)
    assert [o.token_ids for o in dicts] == [o.token_ids for o in plain]
    assert llm.generate({"prompt_token_ids": ids}, params)[0].token_ids == plain[1].token_ids  # one dict
    with pytest.raises(ValueError, match="prompt as a dict must hold exactly one key.*got \\['multi_modal_data', "
                                         "'prompt'\\]"):
        llm.generate([{"prompt": text, "multi_modal_data": {}}], params)


def test_the_demo_model_says_it_is_being_built(tmp_path, monkeypatch, caplog, capfd):
    import logging

    from pagoda.engine.demo import demo_model_path

    monkeypatch.setenv("PAGODA_CACHE", str(tmp_path))
    with caplog.at_level(logging.INFO, logger="pagoda.engine"):
        path = demo_model_path()
    assert [r.getMessage() for r in caplog.records] == [
        f"building the demo model (random weights) in {path}: on first start only, a few seconds"]
    assert "Writing model shards" not in capfd.readouterr().err  # transformers' bar for its one shard
    from transformers.utils import logging as tf_logging

    assert tf_logging.is_progress_bar_enabled()  # turned off only while it was built
    caplog.clear()
    assert demo_model_path() == path and not caplog.records  # built once


def test_serve_defaults_are_the_configs_own(monkeypatch):
    """One table: `pagoda serve` with no flags builds the config dataclasses' own defaults, but where a
    field says why the server's differs (serve_default)."""
    import dataclasses
    import os

    from pagoda.client.cli import build_parser
    from pagoda.engine.config import EngineConfig
    from pagoda.server.main import engine_config, server_options
    from pagoda.server.options import ServerOptions

    for name in [n for n in os.environ if n.startswith("PAGODA_")]:
        monkeypatch.delenv(name)
    args = build_parser().parse_args(["serve"])
    for built, default in ((engine_config(args), EngineConfig()), (server_options(args), ServerOptions())):
        differ = {f.name for f in dataclasses.fields(built) if getattr(built, f.name) != getattr(default, f.name)}
        serve_defaults = {f.name for f in dataclasses.fields(built) if "serve_default" in f.metadata}
        assert differ <= serve_defaults, differ - serve_defaults


@pytest.mark.parametrize("flag,value,message", [
    ("--max-queue-wait", "soon", "must be a number of seconds >= 0"), ("--max-queue-wait", "-1", ">= 0"),
    ("--max-queue-wait", "inf", ">= 0"), ("--max-loras", "0", "must be a positive integer"),
    ("--max-lora-rank", "x", "must be a positive integer"), ("--speculative-config", "{", "speculative_config"),
    ("--speculative-config", '{"method": "eagle"}', "method"), ("--lora-modules", "x", "NAME=PATH"),
    ("--http-port", "70000", "must be a port in [0, 65535]"), ("--http-port", "eight", "or off"),
    ("--dtype", "float64", "invalid choice"), ("--engine-process", "yes", "invalid choice"),
])
def test_a_bad_serve_flag_is_a_one_line_error_naming_it(flag, value, message, capsys):
    from pagoda.client.cli import build_parser

    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", flag, value])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and flag in err and message in err, err


@pytest.mark.parametrize("flag,value,field,want", [
    ("--http-port", "off", "http_port", None), ("--http-port", "0", "http_port", 0),
    ("--max-queue-wait", "0", "max_queue_wait_s", None), ("--max-queue-wait", "2.5", "max_queue_wait_s", 2.5),
    ("--quantization", "none", "quantization", None), ("--lora-modules", "a=/p", "lora_modules", (("a", "/p"),)),
    ("--speculative-config", "", "speculative_config", None),
])
def test_a_serve_flag_becomes_its_field(flag, value, field, want, monkeypatch):
    from pagoda.client.cli import build_parser
    from pagoda.server.main import engine_config, server_options

    for name in [n for n in os.environ if n.startswith("PAGODA_")]:
        monkeypatch.delenv(name)
    args = build_parser().parse_args(["serve", flag, value])
    built = server_options(args) if field == "http_port" else engine_config(args)
    assert getattr(built, field) == want


@pytest.mark.parametrize("option,value", [
    ("http_port", 70000), ("served_model_names", ("",)), ("metrics_port", -2), ("tool_call_parser", "xml"),
    ("reasoning_parser", "think"), ("tls_cert", "cert.pem"), ("tls_client_ca", "ca.pem"), ("api_key", "a key"),
    ("keepalive_time", 0), ("max_stop_strings", -1),
])
def test_bad_server_option_names_it(option, value):
    from pagoda.server.options import ServerOptions

    with pytest.raises(ValueError, match=option.split("_")[0] if option.startswith("tls") else option):
        ServerOptions(**{option: value})


def test_the_engine_package_names_what_it_does_not_export():
    import pagoda.engine

    assert pagoda.engine.EngineRequest.__module__ == "pagoda.engine.core.core_io"
    with pytest.raises(AttributeError, match="has no attribute 'Nothing'"):
        pagoda.engine.Nothing  # noqa: B018
