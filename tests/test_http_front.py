"""The OpenAI-compatible HTTP front, as the OpenAI SDK (and raw HTTP) sees it.

One CPU daemon on the default model serves the module, with a front on a free loopback
port in a thread of this process (the deployment runs it as a process of its own: the
last tests start it so). Generations are a few tokens long, and most are text completions
of a short prompt: a chat prompt costs a prefill of ~24 tokens on the CPU backend.
"""

import asyncio
import json
import logging
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_daemon import spawn_serve

from rocforge_client import connect
from rocforge_rt.cli import main
from rocforge_rt.cli.local_daemon import free_loopback_port
from rocforge_rt.server.config import DaemonConfig
from rocforge_rt.server.daemon import Daemon
from rocforge_rt.server.front_process import FrontProcess, connect_address
from rocforge_rt.server.http.app import FrontConfig, create_app
from rocforge_rt.server.http.errors import ApiError
from rocforge_rt.server.http.openai_requests import chat_request, completion_request
from rocforge_rt.server.http.transport import FrontServer, TransportLimits, server_config
from rocforge_rt.server.protocol import parse_request
from rocforge_rt.step.sampling import SamplingParams

CHAT = [  # a short system message: the template's own makes a prompt of 37 tokens, this 24
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is the capital of France?"},
]
PROMPT = "The capital of France is"
PENALTIES = {"min_p": 0.05, "repetition_penalty": 1.3, "frequency_penalty": 1.5,
             "presence_penalty": -0.5}  # fmt: skip
KEY = "sk-test-0123456789"
MAX_NEW_TOKENS = 32


@pytest.fixture(scope="module")
def daemon(default_model: Path) -> Iterator[Daemon]:
    config = DaemonConfig(
        model=default_model,
        backend="cpu",
        bind="tcp://127.0.0.1:*",
        ctx_size=256,
        max_sessions=2,
        max_new_tokens=MAX_NEW_TOKENS,
        max_queue=1,
    )
    with Daemon(config) as d:
        yield d


@contextmanager
def running_front(app: FrontConfig | Any, limits: TransportLimits | None = None) -> Iterator[str]:
    """A front (the app of a FrontConfig, or `app`) served in a thread on a free loopback port
    as `rocforge http` serves it; its base URL."""
    if isinstance(app, FrontConfig):
        app = create_app(app)
    server = FrontServer(server_config(app, "127.0.0.1", 0, limits))
    thread = threading.Thread(target=server.run, name="test-http-front", daemon=True)
    thread.start()
    limit = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < limit, "the front did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture(scope="module")
def url(daemon: Daemon) -> Iterator[str]:
    with running_front(FrontConfig(daemon=daemon.endpoint)) as base:
        wait_for(lambda: httpx.get(f"{base}/health").status_code == 200)
        yield base


@pytest.fixture(scope="module")
def sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(default_model: Path) -> str:
    return default_model.stem


def wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    limit = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < limit, "condition not met in time"
        time.sleep(0.02)


def post(url: str, path: str, body: Any, **kwargs: Any) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json", **kwargs.pop("headers", {})}
    timeout = kwargs.pop("timeout", 120)
    return httpx.post(f"{url}{path}", content=content, headers=headers, timeout=timeout, **kwargs)


def error_of(response: httpx.Response) -> dict[str, Any]:
    """The OpenAI-shaped error of a response: exactly message, type, param, code."""
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def wait_until_idle(daemon: Daemon, timeout: float = 5.0) -> None:
    """The daemon has nothing in flight and no session open (its `health` counts)."""
    with connect(daemon.endpoint, timeout=5) as client:
        wait_for(lambda: _idle(client.health()), timeout)


def _idle(health: dict[str, Any]) -> bool:
    return health["in_flight"] == 0 and health["sessions"] == 0


# --- requests, checked without a daemon ------------------------------------------------------
@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m", "messages": []}, "messages"),
        ({"messages": CHAT}, "model"),
        ({"model": "m", "messages": CHAT, "n": 2}, "n"),
        ({"model": "m", "messages": CHAT, "temperature": 3}, "temperature"),
        ({"model": "m", "messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
        ({"model": "m", "messages": CHAT, "stop": ["a"] * 17}, "stop"),
        ({"model": "m", "messages": CHAT, "max_tokens": 0}, "max_tokens"),
        ({"model": "m", "messages": CHAT, "seed": 1.5}, "seed"),
        ({"model": "m", "messages": CHAT, "frequency_penalty": 2.5}, "frequency_penalty"),
        ({"model": "m", "messages": CHAT, "presence_penalty": -2.01}, "presence_penalty"),
        ({"model": "m", "messages": CHAT, "presence_penalty": "0.5"}, "presence_penalty"),
        ({"model": "m", "messages": CHAT, "min_p": 1.5}, "min_p"),
        ({"model": "m", "messages": CHAT, "min_p": -0.1}, "min_p"),
        ({"model": "m", "messages": CHAT, "repetition_penalty": 0}, "repetition_penalty"),
        ({"model": "m", "messages": CHAT, "repetition_penalty": -1.2}, "repetition_penalty"),
        ({"model": "m", "messages": CHAT, "repetition_penalty": 1e-40}, "repetition_penalty"),
        ({"model": "m", "messages": CHAT, "repetition_penalty": True}, "repetition_penalty"),
        ({"model": "m", "messages": CHAT, "tools": [{"type": "function"}]}, "tools"),
        ({"model": "m", "messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
        (
            {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content[0]",
        ),
    ],
)
def test_a_bad_chat_field_is_refused_by_name(body: dict, param: str) -> None:
    with pytest.raises(ApiError) as info:
        chat_request(body)
    assert (info.value.status, info.value.param) == (400, param)


def test_a_chat_request_becomes_one_generate_with_openais_defaults() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    messages = [{"role": "developer", "content": "be brief"}, {"role": "user", "content": parts}]
    request = chat_request(
        {
            "model": "m",
            "messages": messages,
            "max_completion_tokens": 5,
            "stop": "\n",
            "seed": -1,
            "user": "someone",
            "some_future_field": {"x": 1},  # unknown fields are ignored
            "stream": True,
            "stream_options": {"include_usage": True},
            "logprobs": True,
        }
    )  # fmt: skip
    assert request.fields["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "a\nb"},
    ]
    fields = request.generate_fields(max_new_tokens=32)
    assert fields["temperature"] == 1.0 and fields["max_tokens"] == 5
    with pytest.raises(ApiError, match="'max_completion_tokens' 5 is over"):
        request.generate_fields(max_new_tokens=4)
    assert request.fields["stop"] == ["\n"] and request.fields["seed"] == (1 << 64) - 1
    assert request.stream and request.include_usage
    assert request.logprobs == 0 and request.fields["logprobs"] == 1  # 1 brings token bytes
    assert all(fields[name] is None for name in PENALTIES)  # not sent: the daemon's, none


def test_min_p_and_the_penalties_become_the_generate_fields_of_their_names() -> None:
    """OpenAI's presence and frequency penalties, llama.cpp's and vLLM's min_p and
    repetition_penalty: the daemon's `generate` takes them as they are."""
    request = completion_request({"model": "m", "prompt": "hi", **PENALTIES, "min_p": 0})
    fields = request.generate_fields(max_new_tokens=32)
    assert {name: fields[name] for name in PENALTIES} == {**PENALTIES, "min_p": 0.0}
    sent = {name: value for name, value in fields.items() if value is not None}  # daemon_link's
    generate = parse_request({"op": "generate", **sent})
    assert generate.turn.sampling == SamplingParams(
        temperature=1.0, top_p=1.0, min_p=0.0, repetition_penalty=1.3, frequency_penalty=1.5,
        presence_penalty=-0.5,
    )  # fmt: skip
    chat = chat_request({"model": "m", "messages": CHAT, "frequency_penalty": -2, "min_p": 1})
    assert (chat.fields["frequency_penalty"], chat.fields["min_p"]) == (-2.0, 1.0)


def test_a_penalty_or_min_p_below_float32s_smallest_normal_is_0_as_on_the_device() -> None:
    body = {"model": "m", "prompt": "hi", "min_p": 1e-40, "presence_penalty": -1e-45,
            "frequency_penalty": 1e-39}  # fmt: skip
    fields = completion_request(body).fields
    assert (fields["min_p"], fields["presence_penalty"], fields["frequency_penalty"]) == (0, 0, 0)


def test_a_completion_takes_a_string_or_token_ids_and_16_tokens_by_default() -> None:
    assert completion_request({"model": "m", "prompt": "hi"}).fields["prompt"] == "hi"
    assert completion_request({"model": "m", "prompt": [[1, 2]]}).fields["tokens"] == [1, 2]
    request = completion_request({"model": "m", "prompt": "hi"})
    assert request.generate_fields(max_new_tokens=64)["max_tokens"] == 16
    assert request.generate_fields(max_new_tokens=8)["max_tokens"] == 8  # a default is cut
    for prompt in (["a", "b"], [], [1, -2], None):
        with pytest.raises(ApiError, match="prompt"):
            completion_request({"model": "m", "prompt": prompt})
    with pytest.raises(ApiError, match="echo"):
        completion_request({"model": "m", "prompt": "hi", "echo": True})


# --- the SDK against a daemon ----------------------------------------------------------------
def test_models_lists_the_daemons_model_by_its_file_name(sdk: openai.OpenAI, model: str) -> None:
    (entry,) = sdk.models.list().data
    assert (entry.id, entry.object, entry.owned_by) == (model, "model", "rocforge")
    assert sdk.models.retrieve(model).id == model
    with pytest.raises(openai.NotFoundError):
        sdk.models.retrieve("gpt-4o")


def test_penalties_and_min_p_sample_as_the_zeromq_clients_do(
    sdk: openai.OpenAI, model: str, daemon: Daemon
) -> None:
    """A seeded completion with min_p and the penalties is the ZeroMQ client's with the same
    parameters, which is not the text without them."""
    sampling = {"temperature": 0.9, "seed": 1234, "max_tokens": 8}
    with connect(daemon.endpoint, timeout=120) as client:
        expected = "".join(r.text for r in client.generate(PROMPT, **sampling, **PENALTIES))
        plain = "".join(r.text for r in client.generate(PROMPT, **sampling))
    assert expected != plain
    extensions = {name: PENALTIES[name] for name in ("min_p", "repetition_penalty")}
    reply = sdk.completions.create(
        model=model,
        prompt=PROMPT,
        frequency_penalty=PENALTIES["frequency_penalty"],
        presence_penalty=PENALTIES["presence_penalty"],
        extra_body=extensions,
        **sampling,
    )
    assert reply.choices[0].text == expected and reply.usage.completion_tokens == 8


def test_a_chat_completion_answers_in_openais_shape(sdk: openai.OpenAI, model: str) -> None:
    reply = sdk.chat.completions.create(model=model, messages=CHAT, max_tokens=4, temperature=0)
    assert reply.id.startswith("chatcmpl-") and reply.object == "chat.completion"
    assert reply.model == model and reply.created <= time.time()
    (choice,) = reply.choices
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length" and choice.logprobs is None
    assert reply.usage.completion_tokens == 4 and reply.usage.prompt_tokens > 10
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 4


def test_streamed_chat_text_is_the_zeromq_clients_and_usage_comes_last(
    sdk: openai.OpenAI, model: str, daemon: Daemon
) -> None:
    sampling = {"temperature": 0.9, "seed": 1234, "max_tokens": 6}
    with connect(daemon.endpoint, timeout=120) as client:
        expected = "".join(r.text for r in client.generate(messages=CHAT, **sampling))
    chunks = list(
        sdk.chat.completions.create(
            model=model,
            messages=CHAT,
            stream=True,
            stream_options={"include_usage": True},
            **sampling,
        )
    )
    *content, last = chunks
    assert content[0].choices[0].delta.role == "assistant"
    assert {c.object for c in chunks} == {"chat.completion.chunk"} and len(
        {c.id for c in chunks}
    ) == 1
    assert "".join(c.choices[0].delta.content or "" for c in content) == expected
    assert content[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in content)
    assert last.choices == [] and last.usage.completion_tokens == 6


def test_chat_logprobs_give_each_token_and_its_alternatives(sdk: openai.OpenAI, model: str) -> None:
    reply = sdk.chat.completions.create(
        model=model, messages=CHAT, max_tokens=2, temperature=0, logprobs=True, top_logprobs=2
    )
    tokens = reply.choices[0].logprobs.content
    assert len(tokens) == 2
    assert "".join(t.token for t in tokens) == reply.choices[0].message.content
    for t in tokens:
        assert t.logprob <= 0 and bytes(t.bytes).decode() == t.token
        assert len(t.top_logprobs) == 2
        assert t.top_logprobs[0].token == t.token  # greedy: the best one
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob, abs=1e-5)


def test_a_text_completion_streams_what_it_answers_whole(sdk: openai.OpenAI, model: str) -> None:
    whole = sdk.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0)
    assert whole.id.startswith("cmpl-") and whole.object == "text_completion"
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 4
    chunks = list(
        sdk.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0, stream=True)
    )
    assert {c.object for c in chunks} == {"text_completion"}
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_a_completion_of_token_ids(sdk: openai.OpenAI, model: str) -> None:
    reply = sdk.completions.create(model=model, prompt=[504, 3575, 282], max_tokens=2)
    assert reply.usage.prompt_tokens == 3 and reply.usage.completion_tokens == 2


def test_completion_logprobs_fill_the_legacy_columns(sdk: openai.OpenAI, model: str) -> None:
    reply = sdk.completions.create(
        model=model, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2
    )
    (choice,) = reply.choices
    columns = choice.logprobs
    assert "".join(columns.tokens) == choice.text
    assert columns.text_offset == [0, len(columns.tokens[0]), len("".join(columns.tokens[:2]))]
    assert all(lp <= 0 for lp in columns.token_logprobs)
    for token, top in zip(columns.tokens, columns.top_logprobs, strict=True):
        assert len(top) == 2 and token in top


def test_a_stop_string_ends_the_text_before_it(sdk: openai.OpenAI, model: str) -> None:
    text = sdk.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0)
    words = text.choices[0].text.split()
    stop = words[1]
    cut = sdk.completions.create(
        model=model, prompt=PROMPT, max_tokens=4, temperature=0, stop=[stop, "never"]
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text.choices[0].text[: text.choices[0].text.index(stop)]


# --- errors, over raw HTTP -------------------------------------------------------------------
def test_malformed_json_is_a_400(url: str) -> None:
    response = post(url, "/v1/chat/completions", b'{"model": "m", "messages": [')
    assert response.status_code == 400
    error = error_of(response)
    assert error["type"] == "invalid_request_error" and "not valid JSON" in error["message"]


def test_n_other_than_1_is_a_400_naming_n(url: str, model: str) -> None:
    response = post(url, "/v1/chat/completions", {"model": model, "messages": CHAT, "n": 2})
    assert response.status_code == 400 and error_of(response)["param"] == "n"


def test_an_unknown_model_is_a_404(url: str) -> None:
    response = post(url, "/v1/completions", {"model": "gpt-4o", "prompt": "hi"})
    assert response.status_code == 404
    error = error_of(response)
    assert (error["code"], error["param"]) == ("model_not_found", "model")


def test_an_out_of_range_penalty_or_min_p_is_a_400_naming_it(url: str, model: str) -> None:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 1}
    for name, value, shown in (
        ("presence_penalty", 2.5, "from -2 to 2"),
        ("frequency_penalty", -3, "from -2 to 2"),
        ("min_p", 1.1, "from 0 to 1"),
        ("repetition_penalty", 0, "> 0"),
    ):
        response = post(url, "/v1/completions", {**body, name: value})
        assert response.status_code == 400
        error = error_of(response)
        assert error["param"] == name and shown in error["message"], error


def test_a_prompt_too_long_and_max_tokens_over_the_limit_are_400s(url: str, model: str) -> None:
    response = post(url, "/v1/completions", {"model": model, "prompt": "word " * 400})
    assert response.status_code == 400
    error = error_of(response)
    assert (error["code"], error["param"]) == ("context_length_exceeded", "prompt")
    assert "prompt is too long" in error["message"]
    body = {"model": model, "messages": CHAT, "max_tokens": MAX_NEW_TOKENS + 1}
    response = post(url, "/v1/chat/completions", body)
    assert response.status_code == 400 and error_of(response)["param"] == "max_tokens"


def test_a_body_that_is_not_declared_json_is_a_415(url: str, model: str) -> None:
    """A browser posts text/plain and forms cross-site without asking first: never served."""
    body = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": 1}).encode()
    for content_type in ("text/plain", "application/x-www-form-urlencoded", None):
        headers = {} if content_type is None else {"content-type": content_type}
        response = httpx.post(f"{url}/v1/completions", content=body, headers=headers)
        assert response.status_code == 415, content_type
        assert error_of(response)["code"] == "unsupported_media_type"
    charset = {"content-type": "application/json; charset=utf-8"}
    assert post(url, "/v1/completions", body, headers=charset).status_code == 200


def pending_daemon_requests(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    return families["rocforge:http_daemon_requests_pending"].samples[0].value


@pytest.mark.parametrize("where", ["prompt", "content", "stop"])
def test_a_lone_surrogate_is_a_400_and_the_front_holds_nothing_for_it(
    url: str, model: str, where: str
) -> None:
    """JSON's escapes can spell "\\ud800", which is no Unicode text: refused by name, before
    anything is asked of the daemon."""
    message = '{"role": "user", "content": "\\udfff"}'
    bodies = {
        "prompt": f'{{"model": "{model}", "prompt": "a\\ud800b"}}',
        "content": f'{{"model": "{model}", "messages": [{message}]}}',
        "stop": f'{{"model": "{model}", "prompt": "hi", "stop": ["x\\ud83d"]}}',
    }
    path = "/v1/chat/completions" if where == "content" else "/v1/completions"
    for _ in range(20):
        response = post(url, path, bodies[where].encode())
        assert response.status_code == 400
        assert "lone surrogate" in error_of(response)["message"]
    assert pending_daemon_requests(url) == 0


def test_a_body_over_the_daemons_limit_is_a_413_and_the_streams_beside_it_go_on(
    url: str, model: str, daemon: Daemon
) -> None:
    """1.5 and 3 times --max-request-bytes, while two streams run: the big ones are refused at
    once (the daemon never sees them: its link cannot be cut by one request), and the
    streams get all their tokens (greedy: this prompt's first 32 tokens hold no end)."""
    limit = daemon.config.max_request_bytes
    body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_NEW_TOKENS, "stream": True,
            "temperature": 0}  # fmt: skip
    ends: list[dict[str, Any]] = []

    def stream() -> None:
        with httpx.Client(base_url=url, timeout=120) as http:
            request = {**body, "stream_options": {"include_usage": True}}
            with http.stream("POST", "/v1/completions", json=request) as response:
                events = [line[6:] for line in response.iter_lines() if line.startswith("data:")]
        ends.append(json.loads(events[-2]))  # the usage chunk, before [DONE]

    streams = [threading.Thread(target=stream) for _ in range(2)]
    for thread in streams:
        thread.start()
    with connect(daemon.endpoint) as client:
        wait_for(lambda: client.health()["sessions"] == 2)
    for size in (limit * 3 // 2, limit * 3):
        started = time.monotonic()
        big = post(url, "/v1/completions", {"model": model, "prompt": "x" * size})
        assert big.status_code == 413 and time.monotonic() - started < 1.0
        assert "--max-request-bytes" in error_of(big)["message"]
    for thread in streams:
        thread.join(120)
    assert [end["usage"]["completion_tokens"] for end in ends] == [MAX_NEW_TOKENS] * 2


def test_a_body_within_the_limit_whose_generate_is_not_is_a_413_from_the_front(
    daemon: Daemon,
) -> None:
    """The `generate` the front sends has fields a body does not (op, id, max_tokens): with
    a model named `m`, a body of exactly --max-request-bytes packs to a few bytes more, and
    the front refuses it rather than have the daemon refuse (or drop) it."""
    limit = daemon.config.max_request_bytes
    with running_front(FrontConfig(daemon=daemon.endpoint, model_name="m")) as base:
        shell = b'{"model":"m","prompt":""}'
        body = shell[:-2] + b"x" * (limit - len(shell)) + shell[-2:]
        assert len(body) == limit
        response = post(base, "/v1/completions", body)
        assert response.status_code == 413
        assert "over the daemon's limit" in error_of(response)["message"]
        assert pending_daemon_requests(base) == 0


def test_a_body_slower_than_its_timeout_is_a_408(daemon: Daemon, model: str) -> None:
    with running_front(FrontConfig(daemon=daemon.endpoint, body_timeout_s=0.5)) as base:
        front = httpx.URL(base)
        with socket.create_connection((front.host, front.port)) as conn:
            conn.sendall(
                f"POST /v1/completions HTTP/1.1\r\nhost: {front.netloc.decode()}\r\n"
                'content-type: application/json\r\ncontent-length: 100\r\n\r\n{"model"'.encode()
            )
            conn.settimeout(5)
            answer = b""
            while b"request_timeout" not in answer:  # the head and the body may come apart
                part = conn.recv(4096)
                if not part:
                    break
                answer += part
    assert answer.startswith(b"HTTP/1.1 408") and b"request_timeout" in answer


def test_unknown_routes_answer_in_openais_shape(url: str) -> None:
    response = httpx.get(f"{url}/v1/embeddings")
    assert response.status_code in (404, 405) and error_of(response)["message"]


def test_the_api_key_guards_v1_but_not_health(daemon: Daemon, model: str) -> None:
    with running_front(FrontConfig(daemon=daemon.endpoint, api_key=KEY)) as base:
        assert httpx.get(f"{base}/health").status_code == 200
        missing = httpx.get(f"{base}/v1/models")
        wrong = httpx.get(f"{base}/v1/models", headers={"Authorization": "Bearer sk-wrong"})
        for response in (missing, wrong):
            assert response.status_code == 401
            assert error_of(response)["code"] == "invalid_api_key"
        sdk = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0)
        assert sdk.models.list().data[0].id == model
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{base}/v1", api_key="sk-wrong", max_retries=0).models.list()


def test_past_the_daemons_queue_a_request_is_a_429(url: str, model: str, daemon: Daemon) -> None:
    body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_NEW_TOKENS, "stream": True}
    with httpx.Client(base_url=url, timeout=120) as http:
        holding = []
        queued: list[httpx.Response] = []
        short = {**body, "max_tokens": 2, "stream": False}
        waiter = threading.Thread(
            target=lambda: queued.append(http.post("/v1/completions", json=short))
        )
        try:
            for _ in range(2):  # every session slot (--max-sessions 2)
                stream = http.stream("POST", "/v1/completions", json=body)
                response = stream.__enter__()
                holding.append(stream)
                assert response.status_code == 200
            waiter.start()  # waits in the daemon's queue (--max-queue 1)
            with connect(daemon.endpoint) as client:
                wait_for(lambda: client.health()["waiting"] == 1)
            refused = http.post("/v1/completions", json={**body, "stream": False})
            assert refused.status_code == 429
            error = error_of(refused)
            assert error["code"] == "busy" and "--max-queue 1" in error["message"]
        finally:
            for stream in holding:
                stream.__exit__(None, None, None)
        waiter.join(60)
    assert queued[0].status_code == 200  # it ran once a slot was free
    wait_until_idle(daemon)


def test_a_front_without_its_daemon_answers_503(model: str) -> None:
    with running_front(FrontConfig(daemon=f"tcp://127.0.0.1:{free_loopback_port()}")) as base:
        assert httpx.get(f"{base}/health").status_code == 503
        for response in (
            httpx.get(f"{base}/v1/models"),
            post(base, "/v1/completions", {"model": model, "prompt": "hi"}),
        ):
            assert response.status_code == 503
            assert error_of(response)["code"] == "daemon_unavailable"


# --- clients that leave ----------------------------------------------------------------------
def test_a_client_that_leaves_mid_stream_has_its_generation_aborted(
    url: str, model: str, daemon: Daemon
) -> None:
    body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_NEW_TOKENS, "stream": True}
    with httpx.Client(base_url=url, timeout=120) as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            first = next(response.iter_lines())
            assert first.startswith("data: {")
        left = time.monotonic()
    wait_until_idle(daemon)
    assert time.monotonic() - left < 5
    with connect(daemon.endpoint) as client:
        assert client.stats(records=1)["records"][0]["finish_reason"] == "abort"


def test_a_client_that_leaves_before_a_whole_reply_has_it_aborted(
    url: str, model: str, daemon: Daemon
) -> None:
    """A client that closes its connection while the daemon generates its whole (not
    streamed) reply has the request aborted."""
    body = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": MAX_NEW_TOKENS})
    front = httpx.URL(url)
    request = (
        f"POST /v1/completions HTTP/1.1\r\nhost: {front.netloc.decode()}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n{body}"
    )
    with (
        connect(daemon.endpoint, timeout=5) as client,
        socket.create_connection((front.host, front.port)) as conn,
    ):
        conn.sendall(request.encode())
        wait_for(lambda: client.health()["in_flight"] == 1)
    wait_until_idle(daemon)
    with connect(daemon.endpoint) as client:
        assert client.stats(records=1)["records"][0]["finish_reason"] == "abort"


# --- the log ---------------------------------------------------------------------------------
def test_each_request_logs_a_line(url: str, model: str, caplog) -> None:
    caplog.set_level(logging.INFO, logger="rocforge.http")
    post(url, "/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": 2})
    post(url, "/v1/completions", {"model": "nope", "prompt": PROMPT})

    def lines() -> list[dict]:
        return [r.fields for r in caplog.records if "status" in getattr(r, "fields", {})]

    # the front logs a request once its response is sent: the client may see it first, and
    # the two lines may come in either order
    wait_for(lambda: len(lines()) >= 2)
    done, refused = sorted(lines()[-2:], key=lambda fields: fields["status"])
    assert (done["method"], done["path"], done["status"]) == ("POST", "/v1/completions", 200)
    assert done["completion_tokens"] == 2 and done["prompt_tokens"] > 0
    assert done["finish_reason"] == "length" and done["duration_ms"] > 0
    assert (refused["status"], refused["error"]) == (404, "model_not_found")


# --- metrics ---------------------------------------------------------------------------------
def samples_of(text: str) -> dict[str, float]:
    return {
        s.name + json.dumps(s.labels, sort_keys=True): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_metrics_give_the_daemons_then_the_fronts_own_without_a_key(daemon: Daemon, model: str):
    with running_front(FrontConfig(daemon=daemon.endpoint, api_key=KEY)) as base:
        auth = {"authorization": f"Bearer {KEY}"}
        post(base, "/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": 2},
             headers=auth)  # fmt: skip
        response = httpx.get(f"{base}/metrics")  # no key, as /health
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    samples = samples_of(response.text)
    assert samples["rocforge:generation_tokens_total{}"] >= 2  # the daemon's
    assert samples["rocforge:daemon_up{}"] == 1
    done = {"method": "POST", "route": "/v1/completions", "status": "200"}
    assert samples["rocforge:http_requests_total" + json.dumps(done, sort_keys=True)] == 1


def test_metrics_without_a_daemon_are_the_fronts_with_daemon_up_0() -> None:
    port = free_loopback_port()  # nothing listens there
    with running_front(FrontConfig(daemon=f"tcp://127.0.0.1:{port}")) as base:
        httpx.get(f"{base}/v1/nowhere")
        response = httpx.get(f"{base}/metrics")
    samples = samples_of(response.text)
    assert response.status_code == 200 and samples["rocforge:daemon_up{}"] == 0
    other = {"method": "GET", "route": "other", "status": "404"}
    assert samples["rocforge:http_requests_total" + json.dumps(other, sort_keys=True)] == 1


def test_a_streamed_event_is_one_line_for_line_readers_that_split_on_unicode_breaks():
    from rocforge_rt.server.http.app import _sse

    text = 'a\x1c\x1d\x1e\x85\u2028\u2029é\n"b'  # a sampled token may hold any of these
    lines = list(httpx.Response(200, content=_sse({"text": text})).iter_lines())
    assert lines == [lines[0], ""] and lines[0].startswith("data: {")
    assert json.loads(lines[0][6:]) == {"text": text}


async def stream_completion(http: httpx.AsyncClient, body: dict[str, Any]) -> dict[str, Any]:
    """A streamed completion's status, text and last chunk's finish reason and usage."""
    text, last = [], {}
    async with http.stream("POST", "/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                text += [c["text"] for c in chunk["choices"]]
                last = {**last, **{k: v for k, v in chunk.items() if v}}
    return {"status": response.status_code, "text": "".join(text), "last": last}


def test_32_streams_against_4_slots_all_complete_with_the_queue_in_the_metrics(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    from rocforge_rt.model.synthetic import write_synthetic_model

    model = write_synthetic_model("tiny-k", tmp_path_factory.mktemp("m") / "t.gguf", seed=5,
                                  progress=False, vocab=True)  # fmt: skip
    config = DaemonConfig(model=model, backend="cpu", bind="tcp://127.0.0.1:*", ctx_size=64,
                          max_sessions=4, max_new_tokens=8)  # fmt: skip
    body = {"model": model.stem, "prompt": "hello there", "max_tokens": 6, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    waiting_seen: list[float] = []

    async def run(base: str) -> list[dict[str, Any]]:
        limits = httpx.Limits(max_connections=40)
        async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits) as http:
            streams = asyncio.gather(*(stream_completion(http, body) for _ in range(32)))
            while not streams.done():
                text = (await http.get("/metrics")).text
                waiting_seen.append(samples_of(text)["rocforge:num_requests_waiting{}"])
                await asyncio.sleep(0.02)
            return await streams

    with Daemon(config) as daemon, running_front(FrontConfig(daemon=daemon.endpoint)) as base:
        results = asyncio.run(run(base))
        metrics = samples_of(httpx.get(f"{base}/metrics").text)
    assert [r["status"] for r in results] == [200] * 32  # none refused
    assert all(r["last"]["usage"]["completion_tokens"] == 6 for r in results)
    assert max(waiting_seen) > 0  # requests waited for a slot, and the metrics showed it
    assert metrics["rocforge:request_queue_time_seconds_count{}"] == 32
    assert metrics["rocforge:num_requests_waiting{}"] == 0


# --- the commands ----------------------------------------------------------------------------
def test_listening_beyond_loopback_needs_an_api_key(tiny_model: Path, capsys, monkeypatch) -> None:
    monkeypatch.delenv("ROCFORGE_API_KEY", raising=False)
    assert main(["http", "--listen", "0.0.0.0:8000"]) == 2
    assert "refusing to listen on 0.0.0.0:8000 without an API key" in capsys.readouterr().err
    argv = ["serve", "--model", str(tiny_model), "--backend", "cpu", "--http", "0.0.0.0:8000"]
    assert main(argv) == 2  # before the model loads
    assert "pass --http-api-key KEY" in capsys.readouterr().err
    assert connect_address("tcp://0.0.0.0:5555") == "tcp://127.0.0.1:5555"


def test_serve_with_http_starts_its_front_and_stops_it(tiny_model: Path) -> None:
    port = free_loopback_port()
    process, _addr = spawn_serve(
        ["-m", "rocforge_rt.cli"], tiny_model, "--http", f"127.0.0.1:{port}", ctx_size=64
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _status(f"{base}/health") == 200, timeout=60)
        assert httpx.get(f"{base}/v1/models").json()["data"][0]["id"] == tiny_model.stem
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
        err = process.stderr.read()
        assert "HTTP front started" in err and err.count("HTTP front stopped") == 1
        assert "lost the connection" not in err  # the front stops before the daemon's sockets
        with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            pass  # nothing listens there any more
    finally:
        process.kill()
        process.wait()


def test_a_front_that_dies_is_logged_and_the_daemon_goes_on(caplog) -> None:
    caplog.set_level(logging.INFO, logger="rocforge.server")
    front = FrontProcess([sys.executable, "-c", "raise SystemExit(3)"], where="test")
    front.start_when_ready(lambda _timeout: True)
    wait_for(lambda: "exited with code 3" in caplog.text)
    assert front.stop() == 3


def _status(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.HTTPError:
        return None
