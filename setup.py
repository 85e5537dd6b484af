"""Builds the C++ balancing core as ``orchmllm._core``.

Every ``cpp/*.cpp`` file is one concern; ``cpp/bindings.cpp`` holds the single
PYBIND11_MODULE and calls each file's ``register_*`` function. The core links
against nothing but the C++ standard library (no libtorch), so it builds in
seconds and can be benchmarked without torch. It needs GCC or Clang (the greedy
core uses ``unsigned __int128`` keys). The files compile in parallel, one per CPU
(``ORCHMLLM_BUILD_JOBS=N`` sets the number).
"""

from glob import glob

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import setup

ParallelCompile("ORCHMLLM_BUILD_JOBS").install()

ext_modules = [
    Pybind11Extension(
        "orchmllm._core",
        sorted(glob("cpp/*.cpp")),
        include_dirs=["cpp"],
        cxx_std=17,
        extra_compile_args=["-O3"],
    )
]

setup(ext_modules=ext_modules, cmdclass={"build_ext": build_ext})
