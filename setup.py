"""Build script: only the extension work lives here; metadata is in pyproject.toml.

The Cython sources in ``ext/`` compile into ``rmqfast._speedups``. Set
``RMQFAST_NO_EXTENSIONS=1`` to build (and run) the pure-Python package only.
"""

import os

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


setup(ext_modules=extensions())
