"""The `rocforge` command: generated text on stdout, figures on stderr, clear errors; its
conventions: --version, help with defaults, the prompt from stdin or a file, serve's options
from ROCFORGE_* variables, exit status 0 ok, 1 error, 2 usage error, 130 interrupted."""

import argparse
import io
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

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
    assert_refused(done, str(bad), status=1)


def test_an_unknown_backend_is_refused_by_the_parser():
    done = rocforge("generate", "--prompt", "x", "--backend", "tpu")
    assert done.returncode == 2 and "invalid choice" in done.stderr


# --- errors: a message on stderr, exit 2 for bad input (1 for a failure), never a traceback -----
def assert_refused(done: subprocess.CompletedProcess, *fragments: str, status: int = 2) -> None:
    assert done.returncode == status, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    for fragment in fragments:
        assert fragment in done.stderr, done.stderr


def test_generate_refuses_a_context_size_below_two():
    done = rocforge("generate", "--prompt", "x", "--backend", "cpu", "--ctx-size", "0")
    assert_refused(done, "--ctx-size", "must be >= 2, got 0")


def test_generate_on_a_model_without_a_vocabulary_says_so(tiny_model):
    done = rocforge("generate", "--model", str(tiny_model), "--prompt", "x", "--backend", "cpu")
    assert_refused(done, str(tiny_model), "no vocabulary")


def test_generate_chat_on_a_model_without_a_chat_template_says_so(tmp_path):
    from rocforge_rt.model.synthetic import write_synthetic_model

    plain = write_synthetic_model("tiny", tmp_path / "plain.gguf", vocab=True, progress=False)
    done = rocforge("generate", "--model", str(plain), "--chat", "--prompt", "x",
                    "--backend", "cpu")  # fmt: skip
    assert_refused(done, str(plain), "no chat template", "leave --chat out")


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
    from rocforge_rt.cli.local_daemon import free_loopback_port

    addr = f"tcp://127.0.0.1:{free_loopback_port()}"  # nothing listens there
    started = time.monotonic()
    done = rocforge("client", "health", "--addr", addr, timeout=30)
    assert_refused(done, f"no daemon at {addr}", status=1)
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
    assert (
        engine_plan.build(lambda: False, lambda *_: None).backend.device_info()["batch_invariant"]
        is True
    )


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
    built = plan(DaemonConfig(model=tiny_model, backend="cpu", threads=1)).build(
        lambda: False, lambda *_: None
    )
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


def test_the_kv_cache_dtype_reaches_the_engine_from_generate_serve_and_demo(
    tiny_model, default_model, monkeypatch, capsys, caplog
):
    """--kv-cache-dtype on serve, generate and demo: f16 by default, or fp8, anything else a
    usage error naming the choices; DaemonConfig.kv_dtype through plan (checked by name,
    the KV pool logged in fp8's bytes) to the engine's backend; generate's to Engine.load,
    demo's to the daemon it starts."""
    import logging

    from rocforge_rt.cli import build_parser, demo, main
    from rocforge_rt.engine.engine import Engine
    from rocforge_rt.server.config import DaemonConfig, OptionError, plan

    parser = build_parser()
    for command in (["serve"], ["generate", "--prompt", "x"], ["demo"]):
        assert parser.parse_args(command).kv_cache_dtype == "f16"
        assert parser.parse_args([*command, "--kv-cache-dtype", "fp8"]).kv_cache_dtype == "fp8"
        with pytest.raises(SystemExit) as exited:
            parser.parse_args([*command, "--kv-cache-dtype", "fp16"])
        assert exited.value.code == 2
        said = capsys.readouterr().err
        assert "--kv-cache-dtype: invalid choice: 'fp16'" in said and "fp8" in said

    caplog.set_level(logging.INFO, logger="rocforge.server")
    config = DaemonConfig(model=tiny_model, backend="cpu", ctx_size=64, max_sessions=2)
    fp8 = plan(replace(config, kv_dtype="fp8")).build(lambda: False, lambda *_: None)
    hp = fp8.hparams
    per_token = hp.n_layer * (hp.kv_dim_k + hp.kv_dim_v)  # a byte an element
    assert f"KV pool: 2 sessions x 64 tokens x {per_token} bytes (fp8)" in caplog.text
    assert fp8.kv_dtype == fp8.backend.kv_dtype == "fp8"
    with pytest.raises(OptionError, match="--kv-cache-dtype must be one of f16, fp8, got 'e5m2'"):
        plan(replace(config, kv_dtype="e5m2"))

    class Started(Exception):
        pass

    def start(*args, **kwargs):
        raise Started(args, kwargs)

    monkeypatch.setattr(Engine, "load", start)
    with pytest.raises(Started) as started:
        main(["generate", "--model", str(default_model), "--backend", "cpu", "--prompt", "x",
              "--kv-cache-dtype", "fp8"])  # fmt: skip
    assert started.value.args[1]["kv_dtype"] == "fp8"
    monkeypatch.setattr(demo, "LocalDaemon", start)
    with pytest.raises(Started) as started:
        main(["demo", "--model", str(tiny_model), "--kv-cache-dtype", "fp8"])
    serve_args = started.value.args[0][1]
    assert serve_args[serve_args.index("--kv-cache-dtype") + 1] == "fp8"


def test_generate_and_client_generate_take_min_p_and_the_penalties_off_by_default(capsys):
    from rocforge_rt.cli import build_parser, main
    from rocforge_rt.cli.options import sampling_options
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
    assert "min_p must be 0 or a number in [1.1754943508222875e-38, 1.0], got 2.0" in (
        capsys.readouterr().err
    )


# --- conventions ---------------------------------------------------------------------------------
README = Path(__file__).resolve().parents[1] / "README.md"


def all_parsers() -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """(command line, parser) of `rocforge` and of each of its subcommands, depth first."""
    from rocforge_rt.cli import build_parser

    todo = [("rocforge", build_parser())]
    while todo:
        name, parser = todo.pop()
        yield name, parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                todo.extend((f"{name} {sub}", p) for sub, p in action.choices.items())


def option_help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    return parser._get_formatter()._get_help_string(action)


def test_version_names_the_release_and_where_it_runs_from(capsys) -> None:
    import rocforge_rt
    from rocforge_rt.cli import main, version

    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    shown = capsys.readouterr().out
    assert shown.startswith(f"rocforge {version()} from {Path(rocforge_rt.__file__).parent}")


def test_every_option_has_help_and_every_value_option_its_default() -> None:
    for name, parser in all_parsers():
        groups = parser._mutually_exclusive_groups
        required = {id(a) for group in groups if group.required for a in group._group_actions}
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction | argparse._VersionAction):
                continue
            if isinstance(action, argparse._SubParsersAction):  # each command has its help
                assert all(c.help for c in action._choices_actions), name
                continue
            assert action.help, f"`{name}` {action.option_strings or action.dest}: no help"
            optional = not action.required and id(action) not in required
            if action.option_strings and action.nargs != 0 and optional:  # a value, not a switch
                assert "(default" in option_help(parser, action), (name, action.option_strings)


def test_the_top_level_help_lists_every_command_with_what_it_does(capsys) -> None:
    from rocforge_rt.cli import main

    with pytest.raises(SystemExit):
        main(["--help"])
    shown = capsys.readouterr().out
    commands = {name.split()[1] for name, _ in all_parsers() if name.count(" ") == 1}
    assert commands == {"generate", "convert", "models", "kernels", "serve", "client", "trace",
                        "keys", "demo", "http"}  # fmt: skip
    for command in commands:
        assert re.search(rf"^    {command}\s+\w", shown, re.M), command
    for section in ("files:", "environment:", "exit status:", "130 interrupted"):
        assert section in shown


@pytest.mark.parametrize("command", [["generate"], ["client", "generate"]])
def test_the_prompt_comes_from_the_option_stdin_or_a_file(command, tmp_path, monkeypatch, capsys):
    from rocforge_rt.cli import build_parser

    parser = build_parser()
    assert parser.parse_args([*command, "--prompt", "as typed"]).prompt == "as typed"
    monkeypatch.setattr(sys, "stdin", io.StringIO("from stdin\n"))
    assert parser.parse_args([*command, "--prompt", "-"]).prompt == "from stdin\n"
    path = tmp_path / "prompt.txt"
    path.write_text("from a file\nwith two lines\n", encoding="utf-8")
    assert parser.parse_args([*command, "--prompt-file", str(path)]).prompt == path.read_text()
    for wrong in ([], ["--prompt", "x", "--prompt-file", str(path)],
                  ["--prompt-file", str(tmp_path / "absent.txt")]):  # fmt: skip
        with pytest.raises(SystemExit) as exited:
            parser.parse_args([*command, *wrong])
        assert exited.value.code == 2
    assert "cannot read" in capsys.readouterr().err


@pytest.mark.slow
def test_generate_reads_its_prompt_from_stdin(default_model):
    done = subprocess.run(
        [sys.executable, "-m", "rocforge_rt.cli", "generate", "--model", str(default_model),
         "--backend", "cpu", "--prompt", "-", "--max-tokens", "2"],
        input="The capital of France is", capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "prompt_tokens=5" in done.stderr


def test_serve_options_come_from_rocforge_variables_and_flags_win(monkeypatch) -> None:
    from rocforge_rt.cli import build_parser

    monkeypatch.setenv("ROCFORGE_CTX_SIZE", "512")
    monkeypatch.setenv("ROCFORGE_BIND", "tcp://127.0.0.1:6000")
    monkeypatch.setenv("ROCFORGE_BATCH_INVARIANT", "true")
    monkeypatch.setenv("ROCFORGE_GPU_MEMORY_LIMIT", "1GiB")
    monkeypatch.setenv("ROCFORGE_KV_CACHE_DTYPE", "fp8")
    monkeypatch.setenv("ROCFORGE_HTTP_API_KEY", "not read: ROCFORGE_API_KEY is the key")
    serve = build_parser().parse_args(["serve"])
    assert (serve.ctx_size, serve.bind) == (512, "tcp://127.0.0.1:6000")
    assert serve.batch_invariant is True
    assert serve.gpu_memory_limit == 1 << 30
    assert serve.kv_cache_dtype == "fp8"
    assert serve.http_api_key is None
    flags = build_parser().parse_args(["serve", "--ctx-size", "64", "--bind", "ipc:///tmp/x"])
    assert (flags.ctx_size, flags.bind) == (64, "ipc:///tmp/x")
    assert build_parser().parse_args(["generate", "--prompt", "x"]).ctx_size == 2048  # serve's only


@pytest.mark.parametrize(
    ("variable", "value", "said"),
    [
        ("ROCFORGE_CTX_SIZE", "many", "ROCFORGE_CTX_SIZE='many': invalid literal"),
        ("ROCFORGE_BACKEND", "tpu", "ROCFORGE_BACKEND='tpu': choose from auto, cpu, cuda, hip"),
        ("ROCFORGE_BATCH_INVARIANT", "maybe", "expected 1 or 0"),
        ("ROCFORGE_THREADS", "0", "ROCFORGE_THREADS='0': must be >= 1"),
        ("ROCFORGE_KV_CACHE_DTYPE", "e4m3", "ROCFORGE_KV_CACHE_DTYPE='e4m3': choose from f16, fp8"),
    ],
)
def test_a_bad_rocforge_variable_is_a_usage_error_naming_it(variable, value, said, monkeypatch,
                                                            capsys):  # fmt: skip
    from rocforge_rt.cli import build_parser

    monkeypatch.setenv(variable, value)
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["serve"])
    assert exited.value.code == 2 and said in capsys.readouterr().err


def test_serve_help_and_the_readme_name_every_rocforge_variable(capsys) -> None:
    from rocforge_rt.cli import main

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    (serve,) = (parser for name, parser in all_parsers() if name == "rocforge serve")
    variables = [getattr(a, "environment_variable", None) for a in serve._actions]
    variables = [variable for variable in variables if variable]
    assert len(variables) == len(serve._actions) - 2  # all but --help and --http-api-key
    readme = README.read_text()
    for variable in variables:
        assert f"[env: {variable}]" in shown
        assert f"`{variable}`" in readme, f"README.md does not list {variable}"


def test_exit_status_is_0_1_2_or_130(tmp_path, monkeypatch, capsys) -> None:
    from rocforge_rt import cli

    assert cli.main(["models", "default"]) == 0
    assert cli.main(["generate", "--model", str(tmp_path / "absent.gguf"), "--prompt", "x"]) == 1
    assert "absent.gguf: model file" in capsys.readouterr().err  # one line, no traceback
    with pytest.raises(SystemExit) as exited:
        cli.main(["generate", "--max-tokens", "x"])
    assert exited.value.code == 2

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli.models, "_cmd_models_default", interrupted)
    assert cli.main(["models", "default"]) == 130
    assert "rocforge: interrupted" in capsys.readouterr().err


@pytest.fixture
def exports_undone(monkeypatch: pytest.MonkeyPatch) -> None:
    """main() exports --models-dir and --cache-dir (and numba's folder): undone after the test."""
    from rocforge_rt import dirs

    for name in (dirs.MODELS_ENV, dirs.CACHE_ENV, dirs.NUMBA_CACHE_ENV):
        monkeypatch.setenv(name, "")


def test_the_models_and_cache_flags_reach_what_the_command_runs(
    tmp_path, monkeypatch, exports_undone
) -> None:
    from rocforge_rt import cli, dirs

    monkeypatch.setattr(dirs, "_USER_NUMBA_CACHE_DIR", None)
    seen = {}

    def record(args):
        seen.update(models=dirs.models_dir(), cache=dirs.cache_dir(),
                    numba=os.environ["NUMBA_CACHE_DIR"])  # fmt: skip
        return 0

    monkeypatch.setattr(cli.models, "_cmd_models_default", record)
    folders = ["--models-dir", str(tmp_path / "m"), "--cache-dir", str(tmp_path / "c")]
    assert cli.main(["models", "default", *folders]) == 0
    assert seen == {"models": tmp_path / "m", "cache": tmp_path / "c",
                    "numba": str(tmp_path / "c" / "numba")}  # fmt: skip


def test_kernels_check_says_what_it_skipped_and_fails_with_no_compiler(monkeypatch, capsys):
    import rocforge_rt.backends
    from rocforge_rt.cli import main
    from rocforge_rt.errors import BackendError

    assert main(["kernels", "check", "--target", "sm_9x"]) == 2  # no such target

    def absent(target):
        raise BackendError(f"no compiler for {target} here")

    monkeypatch.setattr(rocforge_rt.backends, "kernel_compiler", absent)
    capsys.readouterr()
    assert main(["kernels", "check"]) == 1
    out, err = capsys.readouterr()
    assert "sm_90: skipped, no compiler: no compiler for sm_90 here" in out
    assert "no kernel compiler found" in err
    assert main(["kernels", "check", "--target", "gfx90a"]) == 1  # named: it must compile


def test_kernels_check_compiles_every_source_for_each_target(
    tmp_path, monkeypatch, capsys, exports_undone
):
    from test_kernel_abi import FakeCompiler

    import rocforge_rt.backends
    from rocforge_rt.backends.gpu.kernel_library import kernels_dir
    from rocforge_rt.cli import main

    monkeypatch.setattr(rocforge_rt.backends, "kernel_compiler", lambda target: FakeCompiler())
    assert main(["kernels", "check", "--target", "sm_90", "--cache-dir", str(tmp_path)]) == 0
    sources = len(list(kernels_dir().glob("*.hip")))
    assert f"sm_90: {sources} sources" in capsys.readouterr().out
    assert len(list((tmp_path / "kernels").iterdir())) == sources


def test_kernels_build_fills_the_cache_and_writes_a_wheels_objects_with_out(
    tmp_path, monkeypatch, capsys, exports_undone
):
    from test_kernel_abi import FakeCompiler

    import rocforge_rt.backends
    from rocforge_rt.backends.gpu.kernel_library import KernelLibrary, kernels_dir
    from rocforge_rt.cli import main

    monkeypatch.setattr(rocforge_rt.backends, "kernel_compiler", lambda target: FakeCompiler())
    out, cache = tmp_path / "prebuilt", tmp_path / "cache"
    args = ["kernels", "build", "--target", "sm_90", "--cache-dir", str(cache), "--out", str(out)]
    assert main(args) == 0
    sources = len(list(kernels_dir().glob("*.hip")))
    printed = capsys.readouterr().out
    assert f"sm_90: {sources} sources" in printed and f"({sources} compiled, 0 cached" in printed
    assert len(list((cache / "kernels").iterdir())) == len(list(out.iterdir())) == sources
    wheel = KernelLibrary(FakeCompiler(), cache_dir=tmp_path / "empty", prebuilt=out)
    assert wheel.missing() == []

    assert main(args) == 0  # again: all cached
    assert f"(0 compiled, {sources} cached, 0 from the wheel)" in capsys.readouterr().out


def test_kernels_build_without_a_target_or_a_gpu_says_to_name_one(monkeypatch, capsys):
    import rocforge_rt.backends
    from rocforge_rt.cli import main

    monkeypatch.setattr(rocforge_rt.backends, "resolve_backend_name", lambda name: "cpu")
    assert main(["kernels", "build"]) == 2  # a usage error
    assert "no GPU found to build for: name the targets, e.g. --target sm_90" in (
        capsys.readouterr().err
    )
