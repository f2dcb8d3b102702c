"""Kernel library: finds ``kernels/*.hip``, compiles them per target, caches the results.

The sources are the repository's ``kernels/`` folder, installed as package data
(``rocforge_rt/_kernels``): `kernels_dir` finds them in a checkout or an install.

One source tree builds for every vendor: a `Compiler` (NVRTC or hiprtc, from the
backends) turns a source into a code object (an ELF: CUBIN or AMD HSACO). Code
objects are cached on disk (``kernels/`` in the cache folder of rocforge_rt/dirs.py)
under a sha256 of everything that shapes them (source, header contents, vendor, arch,
defines, compiler version), so a warm start compiles nothing. A wheel built with
ROCFORGE_PREBUILT_TARGETS set (setup.py) also holds code objects of those targets
(``rocforge_rt/_prebuilt``), keyed the same but for the compiler's version: a source
found neither in the cache nor there is compiled, the missing ones in parallel
(`KernelLibrary.build`). Every compile gets the shared constants of kernel_constants.py
(`KERNEL_DEFINES`) and ``RF_WARP_SIZE`` from the compiler's target as -D defines.

A source's variant kernels are generated from the tables of kernel_variants.py and
appended to it (`kernel_source`) before it is compiled, hashed or read. Each kernel's
parameter list is read from its C declaration (`kernel_signatures`) and mapped to the
launch argument codes of launch.py (`C_ARG_TYPES`), so a launch packs its arguments as
the kernel declares them.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import json
import os
import re
import struct
import tempfile
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from rocforge_rt import dirs
from rocforge_rt.backends.gpu.kernel_constants import KERNEL_DEFINES
from rocforge_rt.backends.gpu.kernel_variants import generated_source

_IDENTIFIER_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_KERNEL_RE = re.compile(
    r"\bRF_KERNEL(?:_BOUNDS(?:_ONE)?\s*\([^)]*\))?\s+void\s+([A-Za-z_]\w*)\s*\("
)
_COMMENT_RE = re.compile(r"//[^\n]*|/\*.*?\*/", re.DOTALL)
# An object-like macro (no parameter list) on one line, continuations joined.
_OBJECT_MACRO_RE = re.compile(r"^[ \t]*#[ \t]*define[ \t]+([A-Za-z_]\w*)(?![\w(])(.*)$", re.M)
_WORD_RE = re.compile(r"[A-Za-z_]\w*")
_TOKEN_RE = re.compile(r"[A-Za-z_]\w*|\[[^\]]*\]|\S")
# Words of a declaration that do not change the argument's type as a launch packs it.
_QUALIFIERS = frozenset({"const", "volatile", "__restrict__", "__restrict", "restrict", "struct"})
# Scalar C types of kernel parameters -> launch argument codes (launch.py ARG_TYPES);
# any pointer is "ptr".
C_ARG_TYPES = {
    "int": "i32",
    "signed int": "i32",
    "int32_t": "i32",
    "unsigned": "u32",
    "unsigned int": "u32",
    "uint32_t": "u32",
    "float": "f32",
    "int64_t": "i64",
    "long long": "i64",
    "long long int": "i64",
}
KERNELS_ENV = "ROCFORGE_KERNELS_DIR"
PREBUILT_PACKAGE_DIR = "_prebuilt"  # the wheel's code objects, under rocforge_rt/
_CACHE_FORMAT = 1  # bump when the key derivation or the file layout changes
_ELF_MAGIC = b"\x7fELF"


class Compiler(Protocol):
    """What the kernel library needs of a compiler backend."""

    vendor: str  # 'cuda' | 'hip'
    arch: str  # e.g. 'sm_90', 'gfx90a', 'gfx1030'
    version: str  # compiler identity and fixed options; part of the cache key
    warp_size: int  # lanes per warp/wavefront on `arch`; passed as RF_WARP_SIZE

    def compile(
        self,
        source: str,
        filename: str,
        headers: Mapping[str, str],
        defines: Mapping[str, str | int],
    ) -> bytes: ...


@dataclass(frozen=True)
class CodeObject:
    """One kernel source compiled for one target."""

    source: str  # file name in the kernels directory, e.g. 'embedding.hip'
    vendor: str
    arch: str
    key: str  # sha256 cache key (hex)
    code: bytes  # ELF: CUBIN (cuda) or code object (hip)
    origin: str  # "compiled", "cache" or "prebuilt" (the wheel's)
    kernels: tuple[str, ...]  # kernel names the source declares, in source order
    signatures: dict[str, tuple[str, ...]]  # each kernel's launch argument types


def kernels_dir() -> Path:
    """The kernel sources: $ROCFORGE_KERNELS_DIR, else a source checkout's ``kernels/``, else
    the installed package's copy (``rocforge_rt/_kernels``, package data)."""
    override = os.environ.get(KERNELS_ENV)
    if override:
        return Path(override)
    root = dirs.checkout_root()
    if root is not None:
        return root / "kernels"
    return Path(str(importlib.resources.files("rocforge_rt") / "_kernels"))


def prebuilt_dir() -> Path:
    """The installed package's code objects (``rocforge_rt/_prebuilt``; absent in a
    checkout and in a wheel built without ROCFORGE_PREBUILT_TARGETS)."""
    return Path(str(importlib.resources.files("rocforge_rt") / PREBUILT_PACKAGE_DIR))


def kernel_source(source_dir: Path, source_name: str) -> str:
    """The text a kernel source compiles as: the file, then its kernels generated from
    kernel_variants.py (`generated_source`)."""
    return (source_dir / source_name).read_text() + generated_source(source_name)


def kernel_names(source: str) -> list[str]:
    """Names of the kernels a source declares with RF_KERNEL / RF_KERNEL_BOUNDS(...)."""
    return _KERNEL_RE.findall(_COMMENT_RE.sub(" ", source))


def _object_macros(*texts: str) -> dict[str, str]:
    """The object-like macros the texts #define (comments dropped), later texts winning."""
    macros: dict[str, str] = {}
    for text in texts:
        joined = _COMMENT_RE.sub(" ", text).replace("\\\n", " ")
        macros.update((name, body.strip()) for name, body in _OBJECT_MACRO_RE.findall(joined))
    return macros


def _expand(text: str, macros: Mapping[str, str]) -> str:
    """`text` with object-like macros expanded until none is left (as the preprocessor)."""
    for _ in range(32):
        expanded = _WORD_RE.sub(lambda m: f" {macros[m[0]]} " if m[0] in macros else m[0], text)
        if expanded == text:
            return text
        text = expanded
    raise ValueError(f"macro expansion does not end: {text.strip()!r}")


def _split_top_level(text: str, separator: str) -> list[str]:
    """`text` split at each `separator` outside brackets."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char in "([{<":
            depth += 1
        elif char in ")]}>":
            depth -= 1
        elif char == separator and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def _declaration(text: str) -> tuple[str, str, bool]:
    """(C type without qualifiers, name or "", whether a pointer) of one declaration."""
    tokens = [t for t in _TOKEN_RE.findall(text) if t not in _QUALIFIERS]
    words = [t for t in tokens if _WORD_RE.fullmatch(t)]
    symbols = [t for t in tokens if not _WORD_RE.fullmatch(t)]
    if not words or any(t != "*" and not t.startswith("[") for t in symbols):
        raise ValueError(f"cannot read the declaration {text.strip()!r}")
    name = words[-1] if len(words) > 1 else ""
    return " ".join(words[:-1] if name else words), name, bool(symbols)


def _parameter_list(code: str, start: int) -> str:
    """The text from `start` (just past an opening parenthesis) to the matching one."""
    depth = 1
    for i in range(start, len(code)):
        depth += {"(": 1, ")": -1}.get(code[i], 0)
        if depth == 0:
            return code[start:i]
    raise ValueError("unbalanced parentheses in a kernel declaration")


def kernel_signatures(
    source: str, headers: Mapping[str, str] | None = None
) -> dict[str, tuple[str, ...]]:
    """Each kernel's launch argument types (launch.py ARG_TYPES codes), in source order.

    The parameter lists are read from the RF_KERNEL declarations after expanding the
    object-like macros the headers and the source define (e.g. RF_GEMV_PARAMS,
    RF_RESTRICT); qualifiers are dropped, any pointer is "ptr" and scalars map through
    `C_ARG_TYPES`. A type with no launch code raises ValueError naming the kernel and
    the parameter.
    """
    macros = _object_macros(*(headers or {}).values(), source)
    code = _COMMENT_RE.sub(" ", source)
    signatures: dict[str, tuple[str, ...]] = {}
    for match in _KERNEL_RE.finditer(code):
        kernel = match[1]
        params = _expand(_parameter_list(code, match.end()), macros).strip()
        types = []
        for index, param in enumerate(_split_top_level(params, ",") if params != "void" else ()):
            try:
                c_type, name, pointer = _declaration(param)
            except ValueError as exc:
                raise ValueError(f"kernel {kernel}, parameter {index}: {exc}") from None
            if not pointer and c_type not in C_ARG_TYPES:
                raise ValueError(
                    f"kernel {kernel}, parameter {index} ({name or 'unnamed'}): C type "
                    f"{c_type!r} has no launch argument type; known: {', '.join(C_ARG_TYPES)} "
                    "and pointers"
                )
            types.append("ptr" if pointer else C_ARG_TYPES[c_type])
        signatures[kernel] = tuple(types)
    return signatures


def struct_fields(source: str, name: str) -> tuple[tuple[str, str], ...]:
    """(C type, field name) of each field of `struct <name> {...}` in a source, in order.

    For the records the host reads or writes itself; one scalar a declaration.
    """
    code = _COMMENT_RE.sub(" ", source)
    found = re.search(rf"\bstruct\s+(?:alignas\s*\([^)]*\)\s*)?{name}\s*\{{([^{{}}]*)\}}", code)
    if found is None:
        raise ValueError(f"struct {name} not found")
    fields = []
    for declaration in filter(str.strip, found[1].split(";")):
        c_type, field, pointer = _declaration(declaration)
        if pointer or not field:
            raise ValueError(f"struct {name}: cannot read the field {declaration.strip()!r}")
        fields.append((c_type, field))
    return tuple(fields)


def elf_function_symbols(code: bytes) -> set[str]:
    """Names of the global functions an ELF64 little-endian object defines.

    Kernels are exported this way in both CUBINs and AMD code objects.
    """
    if code[:4] != _ELF_MAGIC or code[4] != 2 or code[5] != 1:
        raise ValueError("not a little-endian ELF64 object")
    (shoff,) = struct.unpack_from("<Q", code, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", code, 0x3A)
    sections = [
        struct.unpack_from("<IIQQQQIIQQ", code, shoff + i * shentsize) for i in range(shnum)
    ]
    names: set[str] = set()
    for _, sh_type, _, _, offset, size, link, _, _, entsize in sections:
        if sh_type not in (2, 11):  # SHT_SYMTAB, SHT_DYNSYM
            continue
        strtab_offset = sections[link][4]
        for pos in range(offset, offset + size, entsize):
            st_name, st_info, _, st_shndx = struct.unpack_from("<IBBH", code, pos)
            # STT_FUNC, STB_GLOBAL, defined in a section
            if st_info & 0xF == 2 and st_info >> 4 == 1 and st_shndx != 0:
                end = code.index(b"\0", strtab_offset + st_name)
                names.add(code[strtab_offset + st_name : end].decode())
    return names


def _normalize_defines(defines: Mapping[str, str | int]) -> dict[str, str]:
    normalized = {}
    for name, value in defines.items():
        if not _IDENTIFIER_RE.match(name):
            raise ValueError(f"define name {name!r} is not a C identifier")
        if isinstance(value, bool) or not isinstance(value, int | str):
            raise TypeError(f"define {name} must be an int or a str, got {type(value).__name__}")
        text = str(value)
        if not text or any(c.isspace() for c in text):
            raise ValueError(f"define {name} has an empty value or one with whitespace: {text!r}")
        normalized[name] = text
    return normalized


def _sha256(material: Mapping[str, object]) -> str:
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class _Unit:
    """One source as it compiles for one target: its text, headers, defines, and where its
    code object is cached (`key`: with the compiler's version) or prebuilt (without)."""

    source_name: str
    source: str
    headers: dict[str, str]
    defines: dict[str, str]
    vendor: str
    arch: str
    key: str
    cache_path: Path
    object_name: str

    def code_object(self, code: bytes, origin: str) -> CodeObject:
        signatures = kernel_signatures(self.source, self.headers)
        return CodeObject(
            source=self.source_name,
            vendor=self.vendor,
            arch=self.arch,
            key=self.key,
            code=code,
            origin=origin,
            kernels=tuple(signatures),
            signatures=signatures,
        )


class KernelLibrary:
    """Compiles kernel sources for one compiler's target, through an on-disk cache.

    `compiles`, `cache_hits` and `prebuilt_hits` count what `load` and `build` did, so a
    test can prove that a warm start compiles nothing.
    """

    def __init__(
        self,
        compiler: Compiler,
        source_dir: Path | None = None,
        cache_dir: Path | None = None,
        prebuilt: Path | None = None,
    ) -> None:
        """`prebuilt`: a folder of code objects `export_prebuilt` wrote (default: the
        installed package's, `prebuilt_dir`)."""
        self.compiler = compiler
        self.source_dir = source_dir if source_dir is not None else kernels_dir()
        self.cache_dir = cache_dir if cache_dir is not None else dirs.kernel_cache_dir()
        self.prebuilt = prebuilt if prebuilt is not None else prebuilt_dir()
        if not self.source_dir.is_dir():
            raise FileNotFoundError(
                f"kernel sources not found at {self.source_dir}; set {KERNELS_ENV}"
            )
        self.compiles = 0
        self.cache_hits = 0
        self.prebuilt_hits = 0
        self._count = threading.Lock()  # `build` compiles on several threads

    def sources(self) -> list[str]:
        """File names of the kernel sources (``*.hip``), sorted."""
        return sorted(p.name for p in self.source_dir.glob("*.hip"))

    def headers(self) -> dict[str, str]:
        """The headers (``*.h``) every source may include, by include name."""
        return {p.name: p.read_text() for p in sorted(self.source_dir.glob("*.h"))}

    def load(self, source_name: str, defines: Mapping[str, str | int] | None = None) -> CodeObject:
        """The code object of one source (e.g. 'embedding.hip'): from the cache, else the
        wheel's, else compiled (and cached).

        `defines` are extra -D macros; the shared constants (`KERNEL_DEFINES`) and
        RF_WARP_SIZE (from the compiler) are always defined and cannot be changed here.
        Raises `KernelCompileError` when the source does not compile.
        """
        unit = self._unit(source_name, defines)
        code, origin = self._read_cached(unit.cache_path), "cache"
        if code is None:
            code, origin = self._read_cached(self.prebuilt / unit.object_name), "prebuilt"
        if code is None:
            return self.compile(source_name, defines)
        if origin == "cache":
            self.cache_hits += 1
        else:
            self.prebuilt_hits += 1
        return unit.code_object(code, origin)

    def compile(
        self, source_name: str, defines: Mapping[str, str | int] | None = None
    ) -> CodeObject:
        """Compile one source, whatever is cached (a prebuilt object the driver refused),
        and cache the result."""
        unit = self._unit(source_name, defines)
        code = self.compiler.compile(unit.source, source_name, unit.headers, unit.defines)
        with self._count:
            self.compiles += 1
        self._write_cached(unit.cache_path, code)
        return unit.code_object(code, "compiled")

    def missing(self, defines: Mapping[str, str | int] | None = None) -> list[str]:
        """The sources with no code object yet, in the cache or the wheel."""
        missing = []
        for name in self.sources():
            unit = self._unit(name, defines)
            if not unit.cache_path.is_file() and not (self.prebuilt / unit.object_name).is_file():
                missing.append(name)
        return missing

    def build(
        self,
        defines: Mapping[str, str | int] | None = None,
        *,
        jobs: int | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> int:
        """Compile every source `missing` lists, `jobs` at once (default: one a CPU), telling
        `progress(done, total)` after each; returns how many. NVRTC releases the GIL while it
        compiles and hiprtc compiles in a child process, so threads run them in parallel."""
        names = self.missing(defines)
        if not names:
            return 0
        workers = max(1, min(len(names), jobs or os.cpu_count() or 1))
        if progress is not None:
            progress(0, len(names))
        with ThreadPoolExecutor(workers, thread_name_prefix="kernel-compile") as pool:
            futures = [pool.submit(self.compile, name, defines) for name in names]
            for done, future in enumerate(as_completed(futures), 1):
                future.result()  # KernelCompileError: the compiler's log
                if progress is not None:
                    progress(done, len(names))
        return len(names)

    def export_prebuilt(self, into: Path, defines: Mapping[str, str | int] | None = None) -> int:
        """Write every source's code object (cached or compiled now) into `into`, named as
        `load` looks them up in a wheel; returns the bytes written."""
        into.mkdir(parents=True, exist_ok=True)
        written = 0
        for name in self.sources():
            code = self.load(name, defines).code
            (into / self._unit(name, defines).object_name).write_bytes(code)
            written += len(code)
        return written

    def load_all(self, defines: Mapping[str, str | int] | None = None) -> dict[str, CodeObject]:
        """Every source's code object, by file name."""
        return {name: self.load(name, defines) for name in self.sources()}

    def defines(self, defines: Mapping[str, str | int] | None = None) -> dict[str, str]:
        """Every -D define a compile of this library gets: `defines`, then the shared constants
        (`KERNEL_DEFINES`) and RF_WARP_SIZE from the compiler, which `defines` may not change."""
        normalized = _normalize_defines(defines or {})
        for name, value in _normalize_defines(KERNEL_DEFINES).items():
            if normalized.setdefault(name, value) != value:
                raise ValueError(
                    f"{name} comes from kernel_constants.py ({value}), "
                    f"not from the caller ({normalized[name]})"
                )
        warp_size = str(self.compiler.warp_size)
        if normalized.setdefault("RF_WARP_SIZE", warp_size) != warp_size:
            raise ValueError(
                f"RF_WARP_SIZE comes from the target ({self.compiler.arch}: {warp_size}), "
                f"not from the caller ({normalized['RF_WARP_SIZE']})"
            )
        return normalized

    def _unit(self, source_name: str, defines: Mapping[str, str | int] | None) -> _Unit:
        """One source as it compiles for this target, with where its code object lies."""
        source = kernel_source(self.source_dir, source_name)
        headers = self.headers()
        all_defines = self.defines(defines)
        compiler = self.compiler
        material = {
            "format": _CACHE_FORMAT,
            "vendor": compiler.vendor,
            "arch": compiler.arch,
            "filename": source_name,
            "source": source,
            "headers": headers,
            "defines": all_defines,
        }
        key = _sha256({**material, "compiler": compiler.version})
        stem = f"{Path(source_name).stem}.{compiler.vendor}-{compiler.arch}"
        return _Unit(
            source_name=source_name,
            source=source,
            headers=headers,
            defines=all_defines,
            vendor=compiler.vendor,
            arch=compiler.arch,
            key=key,
            cache_path=self.cache_dir / f"{stem}.{key}",
            object_name=f"{stem}.{_sha256(material)}",
        )

    @staticmethod
    def _read_cached(path: Path) -> bytes | None:
        try:
            code = path.read_bytes()
        except FileNotFoundError:
            return None
        return code if code.startswith(_ELF_MAGIC) else None  # a damaged entry is recompiled

    def _write_cached(self, path: Path, code: bytes) -> None:
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.cache_dir, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(code)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
