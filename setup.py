"""Build script: only the extension work lives here; metadata is in pyproject.toml.

The Cython sources in ``ext/`` compile into ``rmqfast._speedups``. Set
``RMQFAST_NO_EXTENSIONS=1`` to build (and run) the pure-Python package only.
"""

import importlib.util
import os
from pathlib import Path

from setuptools import Extension, setup

NO_EXTENSIONS = os.environ.get("RMQFAST_NO_EXTENSIONS", "") not in ("", "0")


def extensions() -> list:
    if NO_EXTENSIONS:
        print("rmqfast: pure-Python build (RMQFAST_NO_EXTENSIONS is set)")
        return []
    from Cython.Build import cythonize

    ext = Extension(
        "rmqfast._speedups",
        sources=["ext/_speedups.pyx"],
        include_dirs=["ext"],
        depends=[str(p) for p in sorted(Path("ext").glob("*.h"))],
        extra_compile_args=["-O3"],
    )
    return cythonize(
        [ext],
        include_path=["ext"],
        compiler_directives={
            "language_level": "3",
            "boundscheck": False,
            "wraparound": False,
            "cdivision": True,
            "initializedcheck": False,
        },
        annotate=os.environ.get("RMQFAST_CYTHON_ANNOTATE") == "1",
    )


def h2_extension() -> list:
    """``rmqfast.grpcfront._h2``: the cffi binding of libnghttp2 for ``[grpc] server = "h2"``; left out, with a
    note, without ``nghttp2/nghttp2.h`` (Debian: libnghttp2-dev) or cffi."""
    if NO_EXTENSIONS:
        return []
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rmqfast", "grpcfront", "_h2build.py")
    try:
        spec = importlib.util.spec_from_file_location("_h2build", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    except ImportError as exc:
        print(f"rmqfast: rmqfast.grpcfront._h2 not built ({exc}); [grpc] server = \"h2\" needs it")
        return []
    if not mod.have_nghttp2():
        print("rmqfast: rmqfast.grpcfront._h2 not built: nghttp2/nghttp2.h not found (install libnghttp2-dev); "
              '[grpc] server = "h2" needs it')
        return []
    return [mod.ffibuilder.distutils_extension(tmpdir=os.path.join("build", "cffi"))]


setup(ext_modules=extensions() + h2_extension())
