"""The `rocforge` command: generated text on stdout, figures on stderr, clear errors."""

import subprocess
import sys

import pytest


def rocforge(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rocforge_rt.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


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
