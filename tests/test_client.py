"""The Python client and the `rocforge` serving commands, on the default model (real text)."""

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from rocforge_client import (
    ERRORS,
    Busy,
    Client,
    ClientError,
    LimitExceeded,
    Timeout,
    TokenReply,
    connect,
    raise_for_error,
)
from rocforge_rt.cli import main
from rocforge_rt.cli.local_daemon import free_loopback_port
from rocforge_rt.cli.serve import parse_size
from rocforge_rt.server.config import DaemonConfig
from rocforge_rt.server.daemon import Daemon
from rocforge_rt.server.protocol import ErrorCode

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def daemon(default_model: Path) -> Iterator[Daemon]:
    config = DaemonConfig(
        model=default_model,
        backend="cpu",
        bind="tcp://127.0.0.1:*",
        ctx_size=256,
        max_sessions=2,
        max_new_tokens=32,
    )
    with Daemon(config) as d:
        yield d


@pytest.fixture()
def client(daemon: Daemon) -> Iterator[Client]:
    with connect(daemon.endpoint, timeout=30) as c:
        yield c


# --- without a daemon ---------------------------------------------------------------------------
def test_every_error_code_has_its_exception_type() -> None:
    assert set(ERRORS) == {code.value for code in ErrorCode}
    for code, error_type in ERRORS.items():
        assert issubclass(error_type, ClientError) and error_type.code == code
    with pytest.raises(Busy, match="busy: full") as info:
        raise_for_error({"id": 1, "ok": False, "error": {"code": "busy", "message": "full"}})
    assert info.value.reply["id"] == 1


def test_a_call_times_out_when_no_daemon_answers() -> None:
    with connect(f"tcp://127.0.0.1:{free_loopback_port()}", timeout=0.2) as client:
        with pytest.raises(Timeout):
            client.health()
        with pytest.raises(TimeoutError):  # Timeout is also the builtin kind
            client.info(timeout=0.1)


def test_sizes_parse_with_binary_units() -> None:
    assert parse_size("1048576") == 1 << 20
    assert parse_size("512M") == parse_size("512MiB") == 512 << 20
    assert parse_size("1.5G") == 3 << 29
    with pytest.raises(Exception, match="not a size"):
        parse_size("lots")


def test_keys_command_writes_a_key_set_once(tmp_path: Path, capsys) -> None:
    assert main(["keys", str(tmp_path / "k")]) == 0
    names = {p.name for p in (tmp_path / "k").iterdir()}
    assert {"server.key", "server.key_secret", "client.key", "client.key_secret"} <= names
    assert (tmp_path / "k" / "authorized_clients" / "client.key").is_file()
    assert "--curve-keys" in capsys.readouterr().out
    assert main(["keys", str(tmp_path / "k")]) == 1  # never overwrites keys


def test_serve_refuses_a_public_bind_without_keys(tiny_model: Path, capsys) -> None:
    argv = ["serve", "--model", str(tiny_model), "--backend", "cpu", "--bind", "tcp://*:5555"]
    assert main(argv) == 2
    assert "refusing to bind tcp://*:5555 without encryption" in capsys.readouterr().err


def test_serve_names_a_missing_model_file(tmp_path: Path, capsys) -> None:
    assert main(["serve", "--model", str(tmp_path / "none.gguf"), "--backend", "cpu"]) == 1
    assert "none.gguf: model file" in capsys.readouterr().err


# --- library ------------------------------------------------------------------------------------
def test_a_chat_generation_streams_the_text_of_open_and_step(client: Client) -> None:
    stream = list(client.generate(messages=CHAT, max_tokens=6))
    opened = client.open(messages=CHAT, max_tokens=6)
    rest = client.step(opened.session, 5)
    assert "".join(r.text for r in stream) == opened.text + rest.text
    assert "Paris" in opened.text + rest.text
    assert stream[-1].finish_reason == rest.finish_reason == "length"
    client.close(opened.session)


def test_a_stop_string_ends_the_turn_and_is_never_sent(client: Client) -> None:
    text = "".join(r.text for r in client.generate(messages=CHAT, max_tokens=8))
    stop = "Paris"
    stream = list(client.generate(messages=CHAT, max_tokens=8, stop=stop))
    assert stream[-1].finish_reason == "stop_string"
    assert "".join(r.text for r in stream) == text[: text.index(stop)]


def test_a_text_turn_appends_to_an_open_session(client: Client) -> None:
    opened = client.open(prompt="The capital of France is", max_tokens=2)
    reply = client.append(opened.session, " The capital of Italy is", max_tokens=3)
    assert reply.usage["prompt_tokens"] > 3 and reply.text
    client.close(opened.session)


def test_logprobs_bring_the_bytes_of_each_token_and_alternative(client: Client) -> None:
    reply = client.call("open", prompt="The capital of France is", max_tokens=1, logprobs=2)
    (token,) = reply["tokens"]
    assert token["bytes"].decode() == token["text"]
    assert len(token["top_bytes"]) == len(token["top_logprobs"]) == 2
    assert all(isinstance(b, bytes) and b for b in token["top_bytes"])
    client.close(reply["session"], token=reply["token"])


def test_leaving_a_generate_loop_early_aborts_the_request(client: Client) -> None:
    for _reply in client.generate(messages=CHAT, max_tokens=32):
        break
    limit = time.monotonic() + 5
    while (client.health()["in_flight"], client.health()["sessions"]) != (0, 0):
        assert time.monotonic() < limit, "the generation was not aborted"
        time.sleep(0.02)
    assert client.stats(records=1)["records"][0]["finish_reason"] == "abort"


def test_one_thread_drives_two_clients_by_polling_their_sockets(daemon: Daemon) -> None:
    with connect(daemon.endpoint, timeout=30) as a, connect(daemon.endpoint, timeout=30) as b:
        alone = "".join(r.text for r in a.generate(messages=CHAT, max_tokens=6))
        requests = {c.socket: (c, c.send("generate", messages=CHAT, max_tokens=6)) for c in (a, b)}
        texts: dict[zmq.Socket, list[str]] = {socket: [] for socket in requests}
        poller = zmq.Poller()
        for socket in requests:
            poller.register(socket, zmq.POLLIN)
        while requests:
            for socket, _ in poller.poll(30_000):
                client, rid = requests[socket]
                reply = TokenReply.from_reply(client.receive(rid))
                texts[socket].append(reply.text)
                if reply.done:
                    poller.unregister(socket)
                    del requests[socket]
    assert ["".join(t) for t in texts.values()] == [alone, alone]


def test_per_call_errors_are_typed(client: Client) -> None:
    with pytest.raises(LimitExceeded):
        client.open(messages=CHAT, max_tokens=33)


# --- the rocforge client commands ---------------------------------------------------------------
def test_client_generate_streams_text_and_reports_latency(daemon: Daemon, capsys) -> None:
    argv = ["client", "generate", "--addr", daemon.endpoint, "--chat", "--max-tokens", "4"]
    assert main([*argv, "--prompt", "What is the capital of France?"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() and "TTFT" in err and "finish_reason=length" in err


def test_the_sampling_flags_reach_the_engine_alike_through_the_daemon_and_in_process(
    daemon: Daemon, default_model: Path, capsys
) -> None:
    """`client generate` and `generate` send min-p and the penalties with the rest: a seeded
    generation with them is the same text either way, and not the text without them."""
    flags = ["--prompt", "The capital of France is", "--temperature", "0.9", "--seed", "1234",
             "--max-tokens", "8"]  # fmt: skip
    penalties = ["--min-p", "0.05", "--repetition-penalty", "1.3", "--frequency-penalty", "1.5",
                 "--presence-penalty", "-0.5"]  # fmt: skip

    def text(*argv: str) -> str:
        assert main(list(argv)) == 0
        return capsys.readouterr().out

    served = text("client", "generate", "--addr", daemon.endpoint, *flags, *penalties)
    local = text("generate", "--model", str(default_model), "--backend", "cpu",
                 "--ctx-size", "256", *flags, *penalties)  # fmt: skip
    plain = text("client", "generate", "--addr", daemon.endpoint, *flags)
    assert served.strip() and served == local and served != plain


def test_client_health_stats_and_trace(daemon: Daemon, tmp_path: Path, capsys) -> None:
    addr = ["--addr", daemon.endpoint]
    assert main(["client", "health", *addr]) == 0
    assert json.loads(capsys.readouterr().out)["ready"] is True
    assert main(["client", "stats", *addr]) == 0
    table = capsys.readouterr().out
    assert "TTFT" in table and "norm_qkv_rope" in table and "recommendations:" in table
    assert "us outside Engine.step)" in table  # the engine thread's loop per step
    assert main(["client", "stats", "--json", *addr]) == 0
    assert "overhead" in json.loads(capsys.readouterr().out)
    assert (
        main(["client", "trace", "--steps", "2", "--output", str(tmp_path / "t.json"), *addr]) == 0
    )
    assert json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert main(["client", "metrics", *addr]) == 0
    assert "# TYPE rocforge:time_to_first_token_seconds histogram" in capsys.readouterr().out


def test_client_commands_report_daemon_errors(daemon: Daemon, capsys) -> None:
    argv = ["client", "generate", "--addr", daemon.endpoint, "--max-tokens", "1000"]
    assert main([*argv, "--prompt", "Hi"]) == 1
    assert "rocforge: error: limit_exceeded" in capsys.readouterr().err


# --- the main job -------------------------------------------------------------------------------
def test_demo_serves_a_chat_reply_and_stops_the_daemon_cleanly(default_model: Path, capsys) -> None:
    assert (
        main(["demo", "--model", str(default_model), "--max-tokens", "4", "--backend", "cpu"]) == 0
    )
    out, err = capsys.readouterr()
    assert out.strip()
    assert "TTFT" in err and "inter-token" in err and "op (host time)" in err
    assert "exit code 0" in err
