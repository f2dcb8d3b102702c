"""The HTTP front over a GPU daemon (run on a GPU machine): the OpenAI SDK streams the same
chat text as the ZeroMQ client for the same seed, with and without the samplers users send
beyond OpenAI's (min_p, repetition_penalty through `extra_body`)."""

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from test_http_front import CHAT, running_front, wait_for

from rocforge_client import connect
from rocforge_rt.backends.gpu import cuda
from rocforge_rt.server.config import DaemonConfig
from rocforge_rt.server.daemon import Daemon
from rocforge_rt.server.http.app import FrontConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(cuda.device_count() == 0, reason="no CUDA device"),
]


@pytest.fixture(scope="module")
def daemon(default_model: Path) -> Iterator[Daemon]:
    config = DaemonConfig(model=default_model, backend="cuda", bind="tcp://127.0.0.1:*",
                          ctx_size=512, max_sessions=2, max_new_tokens=64)  # fmt: skip
    with Daemon(config) as d:
        yield d


@pytest.mark.parametrize(
    ("openai_fields", "extra_fields"),
    [
        ({"temperature": 0.9, "seed": 1234}, {}),
        (
            {"temperature": 0.8, "seed": 7, "frequency_penalty": 0.5, "presence_penalty": 0.3},
            {"min_p": 0.05, "repetition_penalty": 1.2},
        ),
    ],
)
def test_streamed_chat_text_is_the_zeromq_clients_for_the_same_seed(
    daemon: Daemon, default_model: Path, openai_fields: dict, extra_fields: dict
) -> None:
    with connect(daemon.endpoint, timeout=120) as client:
        replies = client.generate(messages=CHAT, max_tokens=48, **openai_fields, **extra_fields)
        expected = "".join(r.text for r in replies)
    with running_front(FrontConfig(daemon=daemon.endpoint)) as base:
        wait_for(lambda: httpx.get(f"{base}/health").status_code == 200)
        sdk = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
        chunks = sdk.chat.completions.create(
            model=default_model.stem, messages=CHAT, stream=True, max_tokens=48,
            extra_body=extra_fields, **openai_fields,
        )  # fmt: skip
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert expected and text == expected
