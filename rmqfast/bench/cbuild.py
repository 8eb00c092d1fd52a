"""Compiling the bench's C tools (``bench/loadgen.c``, ``bench/nullbroker.c``, ``bench/relayfloor.c``)
on first use."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from rmqfast.bench.common import BENCH_SRC, DEFAULT_BUILD_DIR, BenchError

CFLAGS = ["-O2", "-g", "-std=gnu11", "-Wall", "-Wextra"]
TOOL_LIBS = {"loadgen": ["-lm"], "nullbroker": ["-pthread"], "relayfloor": []}


@dataclass(frozen=True)
class Tools:
    """The built binaries and the compiler version that built them."""

    loadgen: Path
    nullbroker: Path
    cc_version: str
    relayfloor: Path | None = None  # None: built by an older call site that did not ask


def _cc() -> str:
    cc = os.environ.get("CC", "gcc")
    if shutil.which(cc) is None:
        raise BenchError(f"C compiler {cc!r} not found; install it (apt-get install gcc) or set CC")
    return cc


def build_tools(build_dir: Path | None = None) -> Tools:
    """Compile the bench's C tools (``TOOL_LIBS``) unless already built."""
    if not (BENCH_SRC / "loadgen.c").is_file():
        raise BenchError(f"{BENCH_SRC / 'loadgen.c'} not found; the bench needs a source checkout of rmqfast")
    build_dir = build_dir or DEFAULT_BUILD_DIR
    build_dir.mkdir(parents=True, exist_ok=True)
    cc = _cc()
    cc_version = subprocess.run([cc, "-dumpfullversion"], capture_output=True, text=True).stdout.strip()
    header = (BENCH_SRC / "remoting.h").read_bytes()
    built: dict[str, Path] = {}
    for name, libs in TOOL_LIBS.items():
        src = BENCH_SRC / f"{name}.c"
        key = hashlib.sha256(
            src.read_bytes() + header + " ".join([cc, cc_version, *CFLAGS, *libs]).encode()
        ).hexdigest()[:12]
        out = build_dir / f"{name}-{key}"
        if not out.exists():
            tmp = build_dir / f".{out.name}.{os.getpid()}.tmp"
            cmd = [cc, *CFLAGS, "-o", str(tmp), str(src), *libs]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                tmp.unlink(missing_ok=True)
                raise BenchError(f"building {name} failed: {' '.join(cmd)}\n{proc.stderr}")
            os.replace(tmp, out)  # atomic: a concurrent build never sees half a binary
            for stale in build_dir.glob(f"{name}-*"):  # builds of earlier sources
                if stale != out:
                    stale.unlink(missing_ok=True)
        built[name] = out
    return Tools(built["loadgen"], built["nullbroker"], cc_version, built["relayfloor"])
