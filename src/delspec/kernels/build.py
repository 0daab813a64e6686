"""Building and loading the compiled kernels (`gguf_blocks.c`, `attention.c`, ...) on this machine.

The C sources are compiled at first use with the compiler that is there (`$CC`, else cc/gcc/clang),
for the instruction set this CPU reports: VNNI dot products (AVX-512 or AVX-VNNI), AVX2 with FMA
and F16C, or portable C (a compiler too old for a path builds the next). The library is cached
in delspec's cache, keyed by the source, the flags and the compiler, so a later run (or a machine
with another CPU sharing the cache) never loads a build made for other instructions. Where no
compiler works, `library()` returns None and says once why; callers then use torch's kernels.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

from delspec.cache import cache_dir, write_atomically

SOURCES = [
    Path(__file__).with_name(name)
    for name in ("gguf_blocks.c", "attention.c", "layer_ops.c", "layers.c", "scores.c")
]
HEADER = Path(__file__).with_name("kernels.h")
_AVX2 = ["-mavx2", "-mfma", "-mf16c"]
_AVX512_VNNI = [*_AVX2, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"]
_AVX_VNNI = [*_AVX2, "-mavxvnni"]
_COMMON = [
    "-O3",
    "-shared",
    "-fPIC",
    "-fopenmp",
    "-ffp-contract=off",
    "-fno-math-errno",
    "-std=gnu11",
]
DISABLE_ENV = "DELSPEC_NO_KERNELS"  # set to 1: never build or load the compiled kernels
# set to "avx2" or "portable": build a narrower path than the CPU reports (for a machine that
# reports instructions it does not run, and to test the paths this CPU would not take)
SIMD_ENV = "DELSPEC_KERNEL_SIMD"


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux reports them (empty elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def simd_paths(flags: frozenset[str], cap: str | None = None) -> list[list[str]]:
    """Compiler flags of the paths this CPU runs, widest first (a compiler too old for one
    builds the next), none wider than `cap` ("avx2" or "portable"; None: no cap)."""
    paths: list[list[str]] = [[]]
    if platform.machine().lower() not in ("x86_64", "amd64") or cap == "portable":
        return paths
    if {"avx2", "fma", "f16c"} <= flags:
        paths.insert(0, _AVX2)
        if cap != "avx2" and "avx_vnni" in flags:
            paths.insert(0, _AVX_VNNI)
        if cap != "avx2" and {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= flags:
            paths.insert(0, _AVX512_VNNI)
    return paths


def simd_cap() -> str | None:
    """The narrower path asked for by $DELSPEC_KERNEL_SIMD, if any (an unknown value is
    ignored, with a notice)."""
    cap = os.environ.get(SIMD_ENV, "").strip().lower() or None
    if cap not in (None, "avx2", "portable"):
        _notice(f"ignoring {SIMD_ENV}={cap!r} (expected avx2 or portable)")
        return None
    return cap


def cpu_name() -> str:
    """The CPU's model name, with its family and model numbers where /proc/cpuinfo has them
    (for results and cache keys). A VM may report only a vendor's product line for cores of
    different generations, whose products differ severalfold: the family and model numbers
    tell them apart."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if not line.strip() and fields:
                break  # the first processor's fields
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or platform.machine()
    if fields.get("cpu family") and fields.get("model"):
        return f"{name} (family {fields['cpu family']}, model {fields['model']})"
    return name


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _notice(message: str) -> None:
    print(f"delspec: {message}", file=sys.stderr, flush=True)


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels, built now if needed; None (after a one-line notice) when they
    cannot be had here."""
    if os.environ.get(DISABLE_ENV) == "1":
        _notice(f"compiled GGUF kernels disabled ({DISABLE_ENV}=1); using torch's kernels")
        return None
    compiler = _compiler()
    if compiler is None:
        _notice("no C compiler found; GGUF weights run on torch's kernels (slower)")
        return None
    try:
        version = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, timeout=30
        ).stdout.splitlines()[:1]
    except (OSError, subprocess.SubprocessError):
        version = []
    texts = [source.read_text() for source in (*SOURCES, HEADER)]
    for simd in simd_paths(cpu_flags(), simd_cap()):
        flags = [*_COMMON, *simd]
        key = hashlib.sha256("\n".join([*texts, *flags, compiler, *version]).encode())
        key = key.hexdigest()[:16]
        path = cache_dir() / "kernels" / f"delspec_kernels-{key}.so"
        if path.is_file():
            break
        target = " ".join(simd) or "portable C"
        _notice(f"building the GGUF block kernels ({target})...")
        try:
            write_atomically(path, lambda out, flags=flags: _compile(compiler, flags, out))
            break
        except (OSError, subprocess.SubprocessError) as exc:
            _notice(f"could not build the GGUF kernels for {target} ({exc})")
    else:
        _notice("no build of the GGUF kernels works here; using torch's kernels (slower)")
        return None
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        _notice(f"could not load the GGUF kernels ({exc}); using torch's kernels (slower)")
        return None
    _declare(lib)
    lib.build_key = key
    return lib


def build_key() -> str:
    """Which build of the kernels this process runs (source, flags, compiler), or "none": part
    of the key of every cached measurement made with them."""
    lib = library()
    return "none" if lib is None else lib.build_key


def _compile(compiler: str, flags: list[str], out: Path) -> None:
    result = subprocess.run(
        [compiler, *flags, f"-I{HEADER.parent}", *map(str, SOURCES), "-o", str(out), "-lm"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if result.returncode != 0:
        errors = [line for line in result.stderr.splitlines() if "error" in line]
        raise subprocess.SubprocessError((errors or result.stderr.splitlines() or ["failed"])[0])


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.dl_simd_level.restype = i32
    lib.dl_tile_bytes.argtypes = [i32, i64, i64]
    lib.dl_tile_bytes.restype = i64
    lib.dl_pack.argtypes = [i32, p, i64, i64, p, i32]
    lib.dl_pack.restype = i32
    lib.dl_gather.argtypes = [i32, p, i64, p, i64, p, i64]
    lib.dl_gather.restype = i32
    lib.dl_matmul.argtypes = [i32, p, i64, i64, p, i64, i64, p, i64, i32]
    lib.dl_matmul.restype = i32
    lib.dl_row_block.argtypes = [i64]
    lib.dl_row_block.restype = i64
    lib.dl_set_block_bytes.argtypes = [i64]
    lib.dl_set_block_bytes.restype = i64
    lib.dl_set_four_tiles.argtypes = [i32]
    lib.dl_set_four_tiles.restype = i32
    lib.dl_set_twin_row.argtypes = [i32]
    lib.dl_set_twin_row.restype = i32
    lib.dl_set_fetch_first.argtypes = [i32]
    lib.dl_set_fetch_first.restype = i32
    lib.dl_dequantize.argtypes = [i32, p, i64, p, i64, p, i32]
    lib.dl_dequantize.restype = i32
    lib.dl_tile_stride.argtypes = [i32, i64]
    lib.dl_tile_stride.restype = i64
    lib.dl_prompt_tiles_ready.restype = i32
    lib.dl_bf16_rows.argtypes = [p, i64, i64, i64, i64, p]
    lib.dl_bf16_rows.restype = None
    lib.dl_prompt_tiles.argtypes = [i32, p, i64, i32, p, i64, p, i64]
    lib.dl_prompt_tiles.restype = i32
    f32 = ctypes.c_float
    lib.dl_attention.argtypes = [p, i64, p, p, p, p, f32, f32, p, p, p, i32, i32, i32, i32]
    lib.dl_attention.argtypes += [i64, i64, i64, f32, f32, i32]
    lib.dl_attention.restype = i32
    lib.dl_rms_norm.argtypes = [p, i64, p, f32, f32, i32, i32, p, i64]
    lib.dl_rms_norm.restype = None
    lib.dl_gated.argtypes = [p, i32, i32, i32, p]
    lib.dl_gated.restype = None
    lib.dl_layers.argtypes = [p, p, i64, p, p, i32, i32, p, i32, i32, i32, p, p]
    lib.dl_layers.restype = i32
    lib.dl_top_logsumexp.argtypes = [p, i64, i32, i64, p, p, p]
    lib.dl_top_logsumexp.restype = None
    lib.dl_row_mass.argtypes = [p, i64, f32, f32]
    lib.dl_row_mass.restype = ctypes.c_double
