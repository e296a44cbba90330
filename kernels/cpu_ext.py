"""Tandem's C++ CPU kernels (kernels/cpu/*.cpp) as torch ops, torch.ops.tandem_cpu.*.

Built on first use with the machine's g++ against the installed torch (its headers, libraries and C++
ABI; OpenMP from torch's own libgomp, already loaded, so the kernels share torch's threads), for this CPU
(-march=native), and cached under ~/.cache/tandem/cpu_ext/<key>: the key hashes the sources, torch's
version, the compiler and the CPU's flags, so a new torch, an edited kernel or another CPU builds anew.
A build takes ~30 s once per machine (`make setup` does it); a file lock keeps the Ray actors that start
together from building it twice. No compiler, a failed build or TANDEM_CPU_KERNELS=0: `available()` is
False (logged once) and callers run the torch references, as before these kernels existed.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCES = ("paged_attention.cpp", "attention_step.cpp", "linear_rows.cpp", "decoder_stack.cpp", "token_bitmask.cpp")
HEADERS = ("paged_attention.h", "vec_math.h")
_SRC_DIR = Path(__file__).parent / "cpu"
_lock = threading.Lock()
_state: dict[str, object] = {}  # "ok": bool once loading was tried, "why": the reason it is off


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    import platform
    return platform.processor() or platform.machine()


def _compiler() -> str:
    return os.environ.get("CXX", "g++")


def _command(src: list[Path], out: Path) -> list[str]:
    from torch.utils.cpp_extension import include_paths, library_paths
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    libs = library_paths()
    # 256-bit vectors: GCC tunes some AVX2 CPUs (e.g. "znver1") for 128-bit ones and splits unaligned stores.
    return [_compiler(), "-O3", "-march=native", "-mprefer-vector-width=256", "-fno-math-errno", "-fopenmp",
            "-shared", "-fPIC", "-std=c++17", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-w",
            *(f"-I{p}" for p in include_paths()), *map(str, src), "-o", str(out),
            *(f"-L{p}" for p in libs), *(f"-Wl,-rpath,{p}" for p in libs), "-lc10", "-ltorch_cpu"]


def cache_dir() -> Path:
    # The same root as zoo/cache.py's and engine/models/gguf.py's cache_root (kernels import neither package).
    root = os.environ.get("TANDEM_CACHE")
    return (Path(root).expanduser() if root else Path.home() / ".cache" / "tandem") / "cpu_ext"


def _key(src: list[Path]) -> str:
    h = hashlib.sha256()
    for p in src:
        h.update(p.name.encode())
        h.update(p.read_bytes())
    try:
        version = subprocess.run([_compiler(), "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = "none"
    for part in (torch.__version__, version, _cpu_flags(), sys.version):
        h.update(part.encode())
    return h.hexdigest()[:16]


def build() -> Path:
    """The built library's path, building it now if this machine has none yet. Raises on failure."""
    src = [_SRC_DIR / s for s in SOURCES]
    target_dir = cache_dir() / _key(src + [_SRC_DIR / h for h in HEADERS])
    lib = target_dir / "tandem_cpu.so"
    if lib.exists():
        return lib
    target_dir.mkdir(parents=True, exist_ok=True)
    with open(target_dir / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same key
        if lib.exists():
            return lib
        tmp = target_dir / f"tandem_cpu.{os.getpid()}.so"
        cmd = _command(src, tmp)
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise RuntimeError(f"building the CPU kernels failed ({cmd[0]} exit {done.returncode}): "
                               f"{done.stderr.strip()[-2000:]}")
        os.replace(tmp, lib)  # atomic: a reader sees no library or a whole one
    return lib


def available() -> bool:
    """Whether torch.ops.tandem_cpu is loaded (building it on the first call)."""
    ok = _state.get("ok")
    if ok is not None:
        return bool(ok)
    with _lock:
        if "ok" in _state:
            return bool(_state["ok"])
        if os.environ.get("TANDEM_CPU_KERNELS", "1") == "0":
            _state.update(ok=False, why="TANDEM_CPU_KERNELS=0")
        else:
            try:
                torch.ops.load_library(str(build()))
                _register_fakes()
                _state.update(ok=True)
            except Exception as e:  # no compiler, a failed build: the torch references serve
                _state.update(ok=False, why=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
                log.warning("C++ CPU kernels are off (%s); CPU attention runs the torch reference", _state["why"])
        return bool(_state["ok"])


def _register_fakes() -> None:
    """Shapes of the ops that compiled graphs hold (inductor traces them with fake tensors)."""
    @torch.library.register_fake("tandem_cpu::paged_attention_layer")
    def _(query, key, value, layer, scale):
        return query.new_empty(query.shape)

    @torch.library.register_fake("tandem_cpu::linear_rows")
    def _(x, packed, bias, n):
        return x.new_empty(x.shape[0], n)

    @torch.library.register_fake("tandem_cpu::token_bitmask")
    def _(logits, bitmask, row_has_grammar, indices, d2t, vocab_size):
        return None


def why_off() -> str | None:
    return None if _state.get("ok") else _state.get("why")  # type: ignore[return-value]


@contextlib.contextmanager
def turned_off():
    """The kernels unavailable inside, so that CPU attention takes the reference: benchmarks' A/B in one process
    (not thread-safe; the engine reads the switch on every call)."""
    available()
    saved = dict(_state)
    _state.update(ok=False, why="turned off")
    try:
        yield
    finally:
        _state.clear()
        _state.update(saved)
