"""Metadata lives in setup.cfg; this file only declares the C extension.

``tessera_rt.dist.comm._hot`` is the plain collectives' plan-hit path (dist/comm/_hot.c).  It is
optional: without a C compiler the install still succeeds and the Python collectives serve
every call (slower by about a microsecond per call; ``tests/collectives/test_hot.py`` fails so the suite
says so).
"""
from setuptools import Extension, setup

setup(ext_modules=[Extension("tessera_rt.dist.comm._hot", ["src/tessera_rt/dist/comm/_hot.c"], optional=True,
                             extra_compile_args=["-Wall"])])
