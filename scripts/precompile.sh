#!/bin/sh
# Byte-compile on the host, once, what the device tests import, so that no Python process in the
# VM compiles (under software emulation, compiling the project and pytest's rewriting of test
# modules cost a minute per pytest process, and seconds per helper process). Writes only
# __pycache__ directories (git ignores them); PYTHONDONTWRITEBYTECODE, if set, is lifted here.
py=${PYTHON:-.venv/bin/python}
unset PYTHONDONTWRITEBYTECODE
"$py" -m compileall -q -j 0 aiordma protocols services harness tests >/dev/null || exit 1
# pytest rewrites the asserts of test modules and plugins into its own cached files.
"$py" -m pytest tests/rxe --collect-only -q -p no:cacheprovider >/dev/null || exit 1
