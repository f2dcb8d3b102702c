"""The `rocforge` command: generated text on stdout, figures on stderr, clear errors."""

import subprocess
import sys
import time

import pytest


def rocforge(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run the command; a failed test (not a hang) if it has not exited within `timeout` s."""
    try:
        return subprocess.run(
            [sys.executable, "-m", "rocforge_rt.cli", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"`rocforge {' '.join(args)}` still running after {timeout} s")


@pytest.mark.slow
def test_generate_writes_only_text_to_stdout_and_figures_to_stderr(default_model):
    done = rocforge(
        "generate", "--model", str(default_model), "--backend", "cpu",
        "--prompt", "The capital of France is", "--max-tokens", "6",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() and "TTFT" not in done.stdout
    for figure in ("TTFT", "prompt", "decode", "tok/s", "finish_reason="):
        assert figure in done.stderr


@pytest.mark.slow
def test_generate_chat_renders_the_template_and_stops_at_the_end_of_the_turn(default_model):
    done = rocforge(
        "generate", "--model", str(default_model), "--backend", "cpu", "--chat",
        "--prompt", "Name one color.", "--max-tokens", "48",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() and "<|im_end|>" not in done.stdout
    assert "finish_reason=stop_token" in done.stderr


def test_models_default_prints_the_existing_model_path(default_model):
    done = rocforge("models", "default")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(default_model)


def test_a_broken_model_file_is_a_clear_error_not_a_traceback(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + bytes(64))
    done = rocforge("generate", "--model", str(bad), "--prompt", "x", "--backend", "cpu")
    assert done.returncode == 2
    assert str(bad) in done.stderr and "Traceback" not in done.stderr


def test_an_unknown_backend_is_refused_by_the_parser():
    done = rocforge("generate", "--prompt", "x", "--backend", "tpu")
    assert done.returncode == 2 and "invalid choice" in done.stderr


# --- bad input: a message on stderr and exit 2, never a traceback ------------------------------
def assert_refused(done: subprocess.CompletedProcess, *fragments: str) -> None:
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    for fragment in fragments:
        assert fragment in done.stderr, done.stderr


def test_generate_refuses_a_context_size_below_two():
    done = rocforge("generate", "--prompt", "x", "--backend", "cpu", "--ctx-size", "0")
    assert_refused(done, "--ctx-size", "must be >= 2, got 0")


def test_generate_on_a_model_without_a_vocabulary_says_so(tiny_model):
    done = rocforge("generate", "--model", str(tiny_model), "--prompt", "x", "--backend", "cpu")
    assert_refused(done, str(tiny_model), "no vocabulary")


def test_a_client_address_without_a_scheme_is_refused_by_name():
    done = rocforge("client", "health", "--addr", "127.0.0.1:5555")
    assert_refused(done, "127.0.0.1:5555", "scheme", "tcp://127.0.0.1:5555")


def test_a_bind_address_without_a_scheme_is_refused_as_such(tiny_model):
    done = rocforge("serve", "--model", str(tiny_model), "--backend", "cpu",
                    "--bind", "127.0.0.1:5556", timeout=60)  # fmt: skip
    assert_refused(done, "127.0.0.1:5556", "scheme", "tcp://127.0.0.1:5556")
    assert "encryption" not in done.stderr and "loopback" not in done.stderr


@pytest.mark.parametrize("port", ["99999", "65536", "-1"])
def test_a_bind_port_outside_1_to_65535_is_refused(tiny_model, port):
    """ZeroMQ would bind port 99999 as 99999 - 65536 = 34463 and -1 as 65535."""
    done = rocforge("serve", "--model", str(tiny_model), "--backend", "cpu",
                    "--bind", f"tcp://127.0.0.1:{port}", timeout=60)  # fmt: skip
    assert_refused(done, f"tcp://127.0.0.1:{port}", "outside 1-65535")


@pytest.mark.parametrize("port", ["0", "*"])
def test_a_bind_to_any_free_port_still_serves(tiny_model, port):
    from rocforge_client import connect
    from rocforge_rt.server.config import DaemonConfig
    from rocforge_rt.server.daemon import Daemon

    config = DaemonConfig(model=tiny_model, backend="cpu", bind=f"tcp://127.0.0.1:{port}",
                          ctx_size=64, max_sessions=1)  # fmt: skip
    with Daemon(config) as daemon, connect(daemon.endpoint, timeout=10) as client:
        assert int(daemon.endpoint.rsplit(":", 1)[1]) > 0
        assert client.health()["ready"]


def test_client_health_answers_no_daemon_within_a_few_seconds():
    from rocforge_rt.server.cli_commands import free_loopback_port

    addr = f"tcp://127.0.0.1:{free_loopback_port()}"  # nothing listens there
    started = time.monotonic()
    done = rocforge("client", "health", "--addr", addr, timeout=30)
    assert_refused(done, f"no daemon at {addr}")
    assert time.monotonic() - started < 20


def test_serve_and_the_operator_commands_take_the_session_quota_and_operator_key():
    from rocforge_rt.cli import build_parser

    parser = build_parser()
    serve = parser.parse_args(["serve", "--max-sessions-per-client", "2", "--operator-key", "k"])
    assert (serve.max_sessions_per_client, serve.operator_key) == (2, "k")
    for command in (["client", "stats"], ["client", "trace"], ["client", "profile"], ["trace"]):
        assert parser.parse_args([*command, "--operator-key", "k"]).operator_key == "k"


def test_serve_and_generate_take_batch_invariance_off_by_default(tiny_model):
    from rocforge_rt.cli import build_parser
    from rocforge_rt.server.config import DaemonConfig, plan

    parser = build_parser()
    for command in (["serve"], ["generate", "--prompt", "x"]):
        assert parser.parse_args(command).batch_invariant is False
        assert parser.parse_args([*command, "--batch-invariant"]).batch_invariant is True
    engine_plan = plan(DaemonConfig(model=tiny_model, backend="cpu", batch_invariant=True))
    assert engine_plan.build(lambda: False).backend.device_info()["batch_invariant"] is True


def test_serve_takes_the_queue_flags_and_shows_their_defaults(capsys):
    from rocforge_rt.cli import build_parser

    parser = build_parser()
    serve = parser.parse_args(["serve"])
    assert (serve.max_queue, serve.max_queue_time) == (128, 60.0)
    serve = parser.parse_args(["serve", "--max-queue", "0", "--max-queue-time", "2.5"])
    assert (serve.max_queue, serve.max_queue_time) == (0, 2.5)
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "--max-queue N" in shown and "(default: 128)" in shown
    assert "--max-queue-time SECONDS" in shown and "(default: 60)" in shown


def test_serve_refuses_a_negative_queue_bound_by_name(tiny_model):
    done = rocforge("serve", "--model", str(tiny_model), "--backend", "cpu",
                    "--bind", "tcp://127.0.0.1:*", "--max-queue", "-1", timeout=60)  # fmt: skip
    assert_refused(done, "--max-queue must be >= 0", "got -1")


@pytest.mark.parametrize("seconds", [-1.0, float("nan"), float("inf")])
def test_a_queue_time_limit_must_be_a_finite_number_of_seconds_at_least_0(tiny_model, seconds):
    from rocforge_rt.server.config import DaemonConfig, ServerError, plan

    with pytest.raises(ServerError, match=f"--max-queue-time must be .* >= 0 .*, got {seconds}"):
        plan(DaemonConfig(model=tiny_model, backend="cpu", max_queue_time_s=seconds))
    assert plan(DaemonConfig(model=tiny_model, backend="cpu", max_queue_time_s=0)).limits


def test_threads_reach_the_cpu_backend_from_generate_serve_and_engine_load(
    tiny_model, default_model, monkeypatch
):
    """--threads on generate and serve (an integer >= 1), DaemonConfig.threads through plan,
    Engine.load(threads=) to the CPU backend: its matmul pool and device_info."""
    import numba

    from rocforge_rt.cli import build_parser, main
    from rocforge_rt.engine.engine import Engine
    from rocforge_rt.server.config import DaemonConfig, plan

    parser = build_parser()
    for command in (["serve"], ["generate", "--prompt", "x"]):
        assert parser.parse_args(command).threads is None  # the physical cores
        assert parser.parse_args([*command, "--threads", "1"]).threads == 1
        with pytest.raises(SystemExit):
            parser.parse_args([*command, "--threads", "0"])
    built = plan(DaemonConfig(model=tiny_model, backend="cpu", threads=1)).build(lambda: False)
    assert built.backend.threads == 1 and built.backend.device_info()["threads"] == 1
    engine = Engine.load(tiny_model, backend="cpu", n_ctx=16, threads=1)
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    engine.logits([1, 2, 3])
    assert numba.get_num_threads() == 1  # set by the backend before its matmul

    class Loaded(Exception):
        pass

    def load(*args, **kwargs):
        raise Loaded(kwargs)

    monkeypatch.setattr(Engine, "load", load)
    with pytest.raises(Loaded) as loaded:
        main(["generate", "--model", str(default_model), "--backend", "cpu", "--prompt", "x",
              "--threads", "1"])  # fmt: skip
    assert loaded.value.args[0]["threads"] == 1


def test_generate_and_client_generate_take_min_p_and_the_penalties_off_by_default(capsys):
    from rocforge_rt.cli import build_parser, main
    from rocforge_rt.server.cli_commands import sampling_options
    from rocforge_rt.step.sampling import SamplingParams

    parser = build_parser()
    for command in (["generate", "--prompt", "x"], ["client", "generate", "--prompt", "x"]):
        assert SamplingParams(**sampling_options(parser.parse_args(command))) == SamplingParams()
        flags = ["--min-p", "0.05", "--repetition-penalty", "1.3", "--frequency-penalty", "-2",
                 "--presence-penalty", "0.5"]  # fmt: skip
        args = parser.parse_args([*command, *flags])
        assert SamplingParams(**sampling_options(args)) == SamplingParams(
            min_p=0.05, repetition_penalty=1.3, frequency_penalty=-2.0, presence_penalty=0.5
        )
    # a bad value is refused before the model loads (this one does not exist)
    assert main(["generate", "--model", "/nonexistent.gguf", "--prompt", "x", "--min-p", "2"]) == 2
    assert "min_p must be in [0, 1], got 2.0" in capsys.readouterr().err
