"""The OpenAI-compatible HTTP API as the official `openai` client sees it, beside gRPC on the same
server: completions and chat, whole and streamed (SSE), n > 1, a batch of prompts, logprobs, errors
with OpenAI's JSON and the right status, and a client that leaves freeing its KV blocks."""
import json
import threading
import time

import httpx
import openai
import pytest

from grpc_fixtures import InProcessServer, engine_config, failing_step, openai_client, slow_steps, tiny_checkpoint, \
    wait_all_blocks_free
from pagoda.client.client import Client
from pagoda.engine import LLM, SamplingParams
from pagoda.server.options import ServerOptions

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def srv():
    s = InProcessServer.for_config(engine_config(tiny_checkpoint(), max_queue_len=4),
                                   ServerOptions(http_port=0)).wait_ready()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def oai(srv):
    return openai_client(srv)


@pytest.fixture(scope="module")
def model(oai):
    return oai.models.list().data[0].id


@pytest.fixture(scope="module")
def grpc_client(srv):
    with Client(srv.target, timeout=60) as c:
        yield c


def test_models_health_and_stats(srv, oai, model):
    assert model == srv.engine.model_info.model_id
    assert httpx.get(srv.http_url + "/health").json() == {"status": "serving"}
    stats = httpx.get(srv.http_url + "/stats").json()
    assert stats["kv_blocks_total"] == srv.engine.stats().num_total_blocks and isinstance(stats["generated_tokens"], int)


def test_greedy_completion_equals_grpc_and_transformers_decode(oai, model, grpc_client):
    out = oai.completions.create(model=model, prompt="Hello world", max_tokens=12, temperature=0,
                                 extra_body={"ignore_eos": True, "return_token_ids": True})
    grpc = grpc_client.generate("Hello world", max_tokens=12, temperature=0, ignore_eos=True)
    assert out.choices[0].model_extra["token_ids"] == list(grpc.token_ids)  # token-identical too
    offline = LLM(tiny_checkpoint(), dtype="float32", num_kv_blocks=64).generate("Hello world", SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True))[0]
    assert out.choices[0].text == grpc.text == offline.text
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 12 and out.usage.prompt_tokens == offline.num_prompt_tokens
    assert out.usage.total_tokens == out.usage.prompt_tokens + 12
    assert out.object == "text_completion" and out.id.startswith("cmpl-")


def test_stream_adds_up_to_the_whole_response(oai, model):
    kw = dict(model=model, prompt="héllo wörld", max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    whole = oai.completions.create(**kw)
    chunks = list(oai.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16


def test_chat_whole_and_streamed(oai, model):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text",
                                                                                          "text": "hi"}]}]
    kw = dict(model=model, messages=messages, max_tokens=10, temperature=0)
    whole = oai.chat.completions.create(**kw, logprobs=True, top_logprobs=2)
    choice = whole.choices[0]
    assert choice.message.role == "assistant" and whole.object == "chat.completion"
    assert len(choice.logprobs.content) == whole.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in choice.logprobs.content)
    chunks = list(oai.chat.completions.create(**kw, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason


def test_n_choices_and_a_batch_of_prompts(oai, model):
    out = oai.completions.create(model=model, prompt=["one", "two"], n=2, max_tokens=5, temperature=0.8, seed=3,
                                 extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert all(c.finish_reason == "length" for c in out.choices)
    assert out.usage.completion_tokens == 20
    again = oai.completions.create(model=model, prompt=[[5, 6, 7]], max_tokens=5, temperature=0, logprobs=2)
    lp = again.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == again.choices[0].text


@pytest.mark.parametrize("kw,param", [
    (dict(top_p=1.5), "top_p"), (dict(max_tokens=-1), "max_tokens"), (dict(n=65), "n"),
    (dict(extra_body={"bogus": 1}), "bogus"), (dict(max_tokens=100000), "max_tokens"),
    (dict(extra_body={"prompt_logprobs": 21}), "prompt_logprobs"), (dict(prompt=[]), "prompt"),
    (dict(extra_body={"bad_words": [" "]}), "bad_words[0]"),
])
def test_a_bad_field_is_a_400_naming_it(oai, model, kw, param):
    kw = {"prompt": "hi", **kw}
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=model, **kw)
    assert e.value.status_code == 400 and e.value.body["param"] == param, e.value.body
    assert e.value.body["type"] == "invalid_request_error" and e.value.body["message"]


def test_unknown_model_and_route_are_404(srv, oai):
    with pytest.raises(openai.NotFoundError) as e:
        oai.completions.create(model="no-such-model", prompt="hi")
    assert "does not exist" in e.value.body["message"] and e.value.body["code"] == "model_not_found"
    r = httpx.post(srv.http_url + "/v1/images/generations", json={})  # a route not served
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.get(srv.http_url + "/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"


def test_a_body_past_the_size_limit_is_413(srv, model):
    r = httpx.post(srv.http_url + "/v1/completions", json={"model": model, "prompt": "x" * (5 * 2**20)})
    assert r.status_code == 413 and "--max-message-bytes" in r.json()["error"]["message"]

    def chunked(size):  # no Content-Length: the body arrives in chunks
        body = json.dumps({"model": model, "prompt": "x" * size, "max_tokens": 1}).encode()
        for i in range(0, len(body), 65536):
            yield body[i:i + 65536]
    r = httpx.post(srv.http_url + "/v1/completions", content=chunked(5 * 2**20),
                   headers={"content-type": "application/json"})
    assert r.status_code == 413 and "--max-message-bytes" in r.json()["error"]["message"]
    r = httpx.post(srv.http_url + "/v1/completions", content=chunked(10), headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text


def test_a_full_queue_is_429_with_retry_after():
    # one request runs, one waits (the queue's one place), a third is refused
    s = InProcessServer.for_config(engine_config(tiny_checkpoint(), max_num_seqs=1, max_queue_len=1),
                                   ServerOptions(http_port=0)).wait_ready()
    try:
        oai = openai.OpenAI(base_url=s.http_url + "/v1", api_key="none", max_retries=0, timeout=60)
        params = dict(model=s.engine.model_info.model_id, prompt="hi", max_tokens=300, stream=True,
                      extra_body={"ignore_eos": True})
        with slow_steps(s.engine, 0.02):
            running = oai.completions.create(**params)
            next(iter(running))  # it has a token: running, not waiting
            waiting = oai.completions.create(**params)
            with pytest.raises(openai.RateLimitError) as e:
                oai.completions.create(**params)
            running.close()
            waiting.close()
        assert e.value.status_code == 429 and e.value.response.headers["retry-after"] == "1"
        assert "queue is full" in e.value.body["message"]
        with Client(s.target, timeout=30) as c:
            wait_all_blocks_free(c)
    finally:
        s.stop()


def test_a_failed_step_is_500(srv, oai, model):
    with failing_step(srv.engine):
        with pytest.raises(openai.InternalServerError) as e:
            oai.completions.create(model=model, prompt="hi", max_tokens=4)
    assert "injected failure" in e.value.body["message"]


def test_raw_response_headers(oai, model):
    raw = oai.completions.with_raw_response.create(model=model, prompt="hi", max_tokens=2)
    assert raw.headers["content-type"] == "application/json" and raw.headers["x-request-id"].startswith("cmpl-")


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_leaves_frees_its_blocks(srv, model, grpc_client, stream):
    body = {"model": model, "prompt": "hi", "max_tokens": 400, "ignore_eos": True, "stream": stream}
    with slow_steps(srv.engine, 0.01):
        if stream:
            with httpx.stream("POST", srv.http_url + "/v1/completions", json=body, timeout=30) as r:
                assert r.status_code == 200
                assert next(r.iter_lines()).startswith("data: {")
        else:
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(srv.http_url + "/v1/completions", json=body, timeout=1.0)
        wait_all_blocks_free(grpc_client, timeout=30)


def test_sse_as_curl_sees_it(srv, model):
    """The README's curl line, its SSE parsed here: data lines of JSON, then data: [DONE]."""
    body = {"model": model, "prompt": "Hello", "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", srv.http_url + "/v1/completions", json=body, timeout=30) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_api_key_and_loading(tmp_path):
    gate = threading.Event()

    def slow_engine():
        from pagoda.engine import AsyncEngine

        gate.wait(60)
        return AsyncEngine(engine_config(tiny_checkpoint()))

    s = InProcessServer(slow_engine, ServerOptions(http_port=0, api_key="sekret"))
    try:
        assert httpx.get(s.http_url + "/health").status_code == 503  # loading; /health needs no key
        r = httpx.get(s.http_url + "/v1/models", headers={"authorization": "Bearer sekret"})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        gate.set()
        s.wait_ready()
        bad = openai.OpenAI(base_url=s.http_url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as e:
            bad.models.list()
        assert e.value.body["code"] == "invalid_api_key"
        good = openai.OpenAI(base_url=s.http_url + "/v1", api_key="sekret", max_retries=0)
        assert good.models.list().data
    finally:
        gate.set()
        s.stop()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            httpx.get(s.http_url + "/health", timeout=1)
        except httpx.TransportError:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the HTTP server is still up after stop()")


def readme_curl_lines() -> list[str]:
    """The curl commands of the README's HTTP section (backslash-continued lines joined)."""
    from grpc_fixtures import REPO

    text = (REPO / "README.md").read_text()
    section = text.split("## The HTTP API (OpenAI-compatible)")[1].split("\n## ")[0]
    block = section.split("```sh\n")[1].split("```")[0].replace("\\\n", " ")
    return [line.strip() for line in block.splitlines() if line.startswith("curl ")]


def test_the_readme_curl_lines_against_pagoda_serve():
    import subprocess

    from grpc_fixtures import ServeProcess

    proc = ServeProcess("--model", tiny_checkpoint(), "--engine-process", "on", "--dtype", "float32", "--device", "cpu",
                        "--num-kv-blocks", "64",
                        "--served-model-name", "pagoda-demo", "demo")
    try:
        proc.wait_ready()
        base = f"127.0.0.1:{proc.http_port}"
        model = "pagoda-demo"  # the README's lines name the demo model; this server answers to that name too
        assert [m["id"] for m in httpx.get(f"http://{base}/v1/models").json()["data"]] == [model, "demo"]
        outputs = []
        for line in readme_curl_lines():
            cmd = line.replace("localhost:8000", base)
            out = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, (cmd, out.stderr)
            outputs.append(out.stdout)
        models, completion, stream = outputs
        assert json.loads(models)["data"][0]["id"] == model
        assert json.loads(completion)["choices"][0]["finish_reason"] in ("stop", "length")
        events = [e for e in stream.split("\n\n") if e.strip()]
        assert events[-1] == "data: [DONE]"
        chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    finally:
        proc.proc.terminate()
        proc.proc.wait(60)


def test_chat_with_a_model_that_has_no_chat_template_is_a_400(tmp_path):
    import glob
    import os

    from pagoda.engine.demo import build_tiny_checkpoint

    path = build_tiny_checkpoint(str(tmp_path / "m"), "llama", initializer_range=0.3)
    for f in glob.glob(os.path.join(path, "chat_template.*")):
        os.remove(f)
    config = os.path.join(path, "tokenizer_config.json")
    with open(config) as f:
        tok = json.load(f)
    tok.pop("chat_template", None)
    with open(config, "w") as f:
        json.dump(tok, f)
    s = InProcessServer.for_config(engine_config(path), ServerOptions(http_port=0)).wait_ready()
    try:
        oai = openai.OpenAI(base_url=s.http_url + "/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.BadRequestError) as e:
            oai.chat.completions.create(model=s.engine.model_info.model_id,
                                        messages=[{"role": "user", "content": "hi"}])
        assert e.value.body["param"] == "messages" and "chat template" in e.value.body["message"]
        assert oai.completions.create(model=s.engine.model_info.model_id, prompt="hi", max_tokens=2).choices
    finally:
        s.stop()


def test_https_and_mutual_tls_follow_the_grpc_settings(tmp_path):
    """--tls-cert/--tls-key serve HTTPS; with --tls-client-ca a client certificate is required."""
    import ssl

    from hardening_fixtures import make_certs

    certs = make_certs(tmp_path / "certs")
    options = ServerOptions(http_port=0, tls_cert=certs["server_cert"], tls_key=certs["server_key"],
                            tls_client_ca=certs["ca"])
    s = InProcessServer.for_config(engine_config(tiny_checkpoint(), num_kv_blocks=32), options)
    try:
        url = f"https://127.0.0.1:{s.server.http_port}/health"
        trusted = ssl.create_default_context(cafile=certs["ca"])
        with pytest.raises(httpx.TransportError):  # plain HTTP, and TLS without a client certificate
            httpx.get(url.replace("https", "http"), timeout=10)
        with pytest.raises(httpx.TransportError):
            httpx.get(url, verify=trusted, timeout=10)
        trusted.load_cert_chain(certs["client_cert"], certs["client_key"])
        assert httpx.get(url, verify=trusted, timeout=10).status_code in (200, 503)
    finally:
        s.stop()


# ---- options both doors share ----

def test_include_stop_str_in_output_on_both_doors(oai, model, grpc_client):
    full = grpc_client.generate("Hello world", max_tokens=16, temperature=0, ignore_eos=True).text
    at = next(i for i in range(2, len(full) - 2) if full.index(full[i:i + 2]) == i)
    stop = full[at:at + 2]
    for include, want in ((False, full[:at]), (True, full[:at + 2])):
        g = grpc_client.generate("Hello world", max_tokens=16, temperature=0, ignore_eos=True, stop=[stop],
                                 include_stop_str_in_output=include)
        h = oai.completions.create(model=model, prompt="Hello world", max_tokens=16, temperature=0, stop=stop,
                                   extra_body={"ignore_eos": True, "include_stop_str_in_output": include})
        assert g.text == h.choices[0].text == want
        assert h.choices[0].finish_reason == "stop"


def test_skip_special_tokens_false_on_both_doors(oai, model, grpc_client, srv):
    """A sampled completion that holds a special token (the tiny model's vocabulary is 6 specials in
    262): its text spells it with skip_special_tokens false, as transformers' decode does."""
    tok = srv.engine.tokenizer
    special = set(tok.all_special_ids)
    for seed in range(20):
        kw = dict(max_tokens=48, temperature=1.0, seed=seed, ignore_eos=True)
        g = grpc_client.generate("Hi", skip_special_tokens=False, **kw)
        if special & set(g.token_ids):
            break
    else:
        pytest.fail("no sampled completion held a special token")
    assert g.text == tok.decode(list(g.token_ids), skip_special_tokens=False)
    assert grpc_client.generate("Hi", **kw).text == tok.decode(list(g.token_ids), skip_special_tokens=True)
    h = oai.completions.create(model=model, prompt="Hi", max_tokens=48, temperature=1.0, seed=seed,
                               extra_body={"ignore_eos": True, "skip_special_tokens": False})
    assert h.choices[0].text == g.text


def test_truncate_prompt_tokens_on_both_doors(oai, model, grpc_client):
    long = [65] * 600  # more than the tiny model's context
    with pytest.raises(openai.BadRequestError):
        oai.completions.create(model=model, prompt=long, max_tokens=2)
    h = oai.completions.create(model=model, prompt=long, max_tokens=2, extra_body={"truncate_prompt_tokens": 100})
    g = grpc_client.generate(long, max_tokens=2, truncate_prompt_tokens=100)
    assert h.usage.prompt_tokens == g.usage.prompt_tokens == 100
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=model, prompt="hi", extra_body={"truncate_prompt_tokens": 0})
    assert e.value.body["param"] == "truncate_prompt_tokens"


@pytest.mark.parametrize("stream", [False, True])
def test_request_timeout_ends_http_calls_and_frees_blocks(srv, model, grpc_client, stream):
    import dataclasses

    state = srv.server.state
    saved = state.options
    state.options = dataclasses.replace(saved, request_timeout=1.0)
    body = {"model": model, "prompt": "hi", "max_tokens": 400, "ignore_eos": True, "stream": stream}
    try:
        with slow_steps(srv.engine, 0.02):
            if stream:
                with httpx.stream("POST", srv.http_url + "/v1/completions", json=body, timeout=60) as r:
                    lines = [line for line in r.iter_lines() if line]
                assert lines[-1] == "data: [DONE]"
                error = json.loads(lines[-2].removeprefix("data: "))["error"]
                assert error["type"] == "timeout" and "--request-timeout" in error["message"]
            else:
                r = httpx.post(srv.http_url + "/v1/completions", json=body, timeout=60)
                assert r.status_code == 504 and "--request-timeout" in r.json()["error"]["message"]
    finally:
        state.options = saved
    wait_all_blocks_free(grpc_client, timeout=30)


@pytest.mark.parametrize("path,prompt", [("/v1/completions", {"prompt": "hi"}),
                                         ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})])
def test_a_stream_past_the_time_limit_claims_no_finish(srv, model, grpc_client, path, prompt):
    """--request-timeout ends a stream as it ends a unary call (gRPC: DEADLINE_EXCEEDED): no chunk
    says an aborted choice finished ("stop"), then the error event, then [DONE]."""
    import dataclasses

    state = srv.server.state
    saved = state.options
    state.options = dataclasses.replace(saved, request_timeout=0.5)
    body = {"model": model, **prompt, "max_tokens": 400, "ignore_eos": True, "stream": True, "n": 2}
    try:
        with slow_steps(srv.engine, 0.02):
            with httpx.stream("POST", srv.http_url + path, json=body, timeout=60) as r:
                lines = [line for line in r.iter_lines() if line]
    finally:
        state.options = saved
    assert lines[-1] == "data: [DONE]"
    *chunks, error = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert error["error"]["type"] == "timeout" and "--request-timeout" in error["error"]["message"]
    assert len(chunks) > 2 and all(c["finish_reason"] is None for chunk in chunks for c in chunk["choices"])
    wait_all_blocks_free(grpc_client, timeout=30)


def test_logit_bias_on_both_doors(oai, model, grpc_client):
    """+100 makes a token the greedy choice every time; -100 bans it (OpenAI's semantics)."""
    g = grpc_client.generate("Hello", max_tokens=8, temperature=0, ignore_eos=True, logit_bias={70: 100.0})
    h = oai.completions.create(model=model, prompt="Hello", max_tokens=8, temperature=0,
                               logit_bias={"70": 100}, extra_body={"ignore_eos": True, "return_token_ids": True})
    assert list(g.token_ids) == h.choices[0].model_extra["token_ids"] == [70] * 8
    free = grpc_client.generate("Hello", max_tokens=8, temperature=0, ignore_eos=True)
    banned = {t: -100.0 for t in set(free.token_ids)}
    g = grpc_client.generate("Hello", max_tokens=8, temperature=0.7, seed=1, ignore_eos=True, logit_bias=banned)
    h = oai.completions.create(model=model, prompt="Hello", max_tokens=8, temperature=0.7, seed=1,
                               logit_bias={str(t): b for t, b in banned.items()},
                               extra_body={"ignore_eos": True, "return_token_ids": True})
    assert not set(g.token_ids) & set(banned) and list(g.token_ids) == h.choices[0].model_extra["token_ids"]
    for bad, param in (({"x": 1}, "logit_bias"), ({"70": 101}, "logit_bias[70]"), ({"99999": 1}, "logit_bias")):
        with pytest.raises(openai.BadRequestError) as e:
            oai.completions.create(model=model, prompt="Hello", max_tokens=2, logit_bias=bad)
        assert e.value.body["param"] == param, e.value.body


def test_echo_puts_the_prompt_before_the_completion(oai, model):
    kw = dict(model=model, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    for prompt, spelled in (("héllo", "héllo"), ([[72, 105], [72]], "Hi")):
        plain = oai.completions.create(prompt=prompt, **kw)
        echoed = oai.completions.create(prompt=prompt, echo=True, **kw)
        assert echoed.choices[0].text == spelled + plain.choices[0].text
    echoed = oai.completions.create(prompt="héllo", echo=True, **kw)
    chunks = list(oai.completions.create(prompt="héllo", echo=True, stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == echoed.choices[0].text


# ---- what a first contact (a new user, OpenAI's own specification) found ----

def _post(srv, path: str, body, **kw) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(srv.http_url + path, content=content, headers={"content-type": "application/json"},
                      timeout=60, **kw)


def _sse(r: httpx.Response) -> list[dict]:
    lines = [line for line in r.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


def test_error_codes_are_strings_or_null(srv, model):
    r = _post(srv, "/v1/completions", {"model": model, "prompt": "hi", "top_p": 7})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_value"
    r = _post(srv, "/v1/completions", {"model": model, "prompt": "hi", "": 1})
    err = r.json()["error"]
    assert r.status_code == 400 and err["message"] == "unknown field ''" and err["param"] == ""
    assert err["code"] == "unknown_parameter"
    r = _post(srv, "/v1/completions", {"model": "nope", "prompt": "hi"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    for r in (httpx.get(srv.http_url + "/v1/completions"), httpx.post(srv.http_url + "/v1/nothing-here", json={})):
        err = r.json()["error"]
        assert r.status_code in (404, 405) and err["type"] != "server_error" and err["code"] is None


def test_more_prompts_than_the_queue_can_hold_is_a_400(srv, model, grpc_client):
    # the fixture's queue holds 4: 5 prompts in one call could never be admitted (no 429 to retry)
    r = _post(srv, "/v1/completions", {"model": model, "prompt": ["a"] * 5, "max_tokens": 1})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "prompt" and "--max-queue-len" in err["message"], err
    import grpc as grpc_lib
    with pytest.raises(grpc_lib.RpcError) as e:
        grpc_client.generate(prompts=["a"] * 5, max_tokens=1)
    assert e.value.code() == grpc_lib.StatusCode.INVALID_ARGUMENT and "--max-queue-len" in e.value.details()
    wait_all_blocks_free(grpc_client)


def test_chat_has_the_refusal_fields(srv, model):
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "logprobs": True}
    whole = _post(srv, "/v1/chat/completions", body).json()["choices"][0]
    assert whole["message"]["refusal"] is None and whole["logprobs"]["refusal"] is None
    chunks = _sse(_post(srv, "/v1/chat/completions", {**body, "stream": True}))
    with_logprobs = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    assert with_logprobs and all(lp["refusal"] is None for lp in with_logprobs)


def test_streamed_text_offsets_run_on_as_in_the_whole_response(srv, model):
    body = {"model": model, "prompt": "Hello", "max_tokens": 8, "temperature": 0, "logprobs": 1, "echo": True,
            "ignore_eos": True}
    whole = _post(srv, "/v1/completions", body).json()["choices"][0]["logprobs"]
    chunks = _sse(_post(srv, "/v1/completions", {**body, "stream": True}))
    streamed = [o for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
                for o in c["choices"][0]["logprobs"]["text_offset"]]
    assert streamed == whole["text_offset"] and streamed == sorted(streamed) and streamed[-1] > 0


def test_null_is_the_default(srv, model):
    nulls = {"echo": None, "n": None, "stream": None, "logprobs": None, "max_tokens": None, "stop": None,
             "temperature": None, "seed": None, "user": "u", "suffix": None, "best_of": None, "stream_options": None}
    r = _post(srv, "/v1/completions", {"model": model, "prompt": "hi", **nulls})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 16, r.text
    r = _post(srv, "/v1/completions", {"model": model, "prompt": None, "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 1, r.text  # the start-of-text token
    chat_nulls = {"stream": None, "logprobs": None, "n": None, "top_logprobs": None, "max_tokens": None,
                  "max_completion_tokens": 3, "store": None, "metadata": None, "tools": None, "tool_choice": None,
                  "parallel_tool_calls": None, "response_format": None}
    r = _post(srv, "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "hi"}],
                                            **chat_nulls})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant", r.text


@pytest.mark.parametrize("path,field,value", [
    ("/v1/completions", "max_tokens", "16"), ("/v1/completions", "max_tokens", True),
    ("/v1/completions", "stream", "yes"), ("/v1/completions", "n", 1.5), ("/v1/completions", "echo", 1),
    ("/v1/completions", "temperature", "0"), ("/v1/chat/completions", "logprobs", "true"),
    ("/v1/chat/completions", "store", True), ("/v1/completions", "best_of", 3),
])
def test_types_are_taken_exactly_as_openai_does(srv, model, path, field, value):
    body = {"model": model, "max_tokens": 2, field: value}
    body.update({"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]})
    r = _post(srv, path, body)
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_chat_roles_and_message_fields_are_checked(srv, model):
    def chat(*messages):
        return _post(srv, "/v1/chat/completions", {"model": model, "max_tokens": 2, "messages": list(messages)})
    r = chat({"role": "bogus", "content": "hi"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].role", r.text
    r = chat({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content[0]", r.text
    r = chat({"role": "user", "content": None})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content", r.text
    # developer is system to the template; an assistant message as the SDK returns it is taken back as is
    sdk_message = {"role": "assistant", "content": "ok", "refusal": None, "annotations": [], "audio": None,
                   "function_call": None, "tool_calls": None}
    r = chat({"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}, sdk_message,
             {"role": "user", "content": [{"type": "text", "text": "more"}]})
    assert r.status_code == 200, r.text


def test_max_tokens_0_with_echo_and_logprobs_scores_the_prompt(srv, oai, model, grpc_client):
    out = oai.completions.create(model=model, prompt="Hello world", max_tokens=0, echo=True, logprobs=1)
    choice = out.choices[0]
    assert choice.text == "Hello world" and out.usage.completion_tokens == 0 and choice.finish_reason == "length"
    lps = choice.logprobs
    assert lps.token_logprobs[0] is None and all(x <= 0 for x in lps.token_logprobs[1:])
    assert len(lps.tokens) == out.usage.prompt_tokens and "".join(lps.tokens) == "Hello world"
    chunks = list(oai.completions.create(model=model, prompt="Hello world", max_tokens=0, echo=True, logprobs=1,
                                         stream=True))
    assert "".join(c.choices[0].text for c in chunks) == "Hello world"
    assert [x for c in chunks for x in c.choices[0].logprobs.token_logprobs] == lps.token_logprobs
    wait_all_blocks_free(grpc_client)


def test_served_model_names_and_models_retrieve():
    s = InProcessServer.for_config(engine_config(tiny_checkpoint()),
                                   ServerOptions(http_port=0, served_model_names=("first", "second"))).wait_ready()
    try:
        oai = openai_client(s)
        assert [m.id for m in oai.models.list().data] == ["first", "second"]
        assert oai.models.retrieve("second").id == "second"
        with pytest.raises(openai.NotFoundError):
            oai.models.retrieve("third")
        out = oai.completions.create(model="second", prompt="hi", max_tokens=2)
        assert out.model == "first"
        with Client(s.target, timeout=60) as c:
            assert c.model_info().model_id == "first"
    finally:
        s.stop()


def test_the_demo_model_is_called_pagoda_demo():
    s = InProcessServer.for_config(engine_config(None), ServerOptions(http_port=0)).wait_ready()
    try:
        assert openai_client(s).models.list().data[0].id == "pagoda-demo"
    finally:
        s.stop()


def test_metrics_tokenize_detokenize_version_and_trailing_slashes(srv, model):
    metrics = httpx.get(srv.http_url + "/metrics")
    assert metrics.status_code == 200 and "pagoda_requests_total" in metrics.text
    tok = _post(srv, "/tokenize", {"model": model, "prompt": "héllo", "return_token_strs": True}).json()
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] > 0 and len(tok["token_strs"]) == tok["count"]
    assert _post(srv, "/detokenize", {"model": model, "tokens": tok["tokens"]}).json()["prompt"].endswith("héllo")
    chat = _post(srv, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > 2
    bad = _post(srv, "/detokenize", {"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens[0]"
    bad = _post(srv, "/tokenize", {"prompt": "\ud800"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"
    assert httpx.get(srv.http_url + "/version").json()["version"]
    r = _post(srv, "/v1/completions/", {"model": model, "prompt": "hi", "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert httpx.get(srv.http_url + "/v1/models/").status_code == 200


@pytest.mark.parametrize("path,fields,param", [
    ("/v1/completions", '"prompt": "a\\ud800b"', "prompt"),
    ("/v1/completions", '"prompt": ["fine", "a\\ud800b"]', "prompt[1]"),
    ("/v1/completions", '"prompt": "a\\ud800b", "stream": true', "prompt"),
    ("/v1/completions", '"prompt": "hi", "stop": ["\\udcff"]', "stop[0]"),
    ("/v1/completions", '"prompt": "hi", "bad_words": ["\\ud800"]', "bad_words[0]"),
    ("/v1/completions", '"prompt": "hi", "guided_regex": "a\\ud800"', "guided_regex"),
    ("/v1/completions", '"prompt": "hi", "guided_json": {"properties": {"\\ud800": {"type": "string"}}}',
     "guided_json"),
    ("/v1/chat/completions", '"messages": [{"role": "user", "content": "a\\ud800"}]', "messages[0].content"),
    ("/v1/chat/completions", '"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]',
     "messages[0].content"),
])
def test_a_lone_surrogate_is_a_400_naming_the_field(srv, model, grpc_client, path, fields, param):
    # JSON's "\ud800" escape unpaired: valid JSON, but no UTF-8 text (a tokenizer's TypeError, once a 500)
    r = _post(srv, path, f'{{"model": "{model}", "max_tokens": 2, {fields}}}'.encode())
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param and "lone surrogate" in err["message"], r.text
    wait_all_blocks_free(grpc_client)
