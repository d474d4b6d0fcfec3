#!/usr/bin/env bash
# `make docs`: the documentation site (mkdocs.yml, docs/), built with `mkdocs build --strict`,
# so a broken link, a page missing from the navigation or a docstring the API reference
# cannot read fails the build. The site goes to build/site.
#
# The docs' Python dependencies are the `docs` extra of pyproject.toml. They are installed
# here, into the venv scripts/setup.sh made, whenever pyproject.toml changed since the last
# install (a stamp, as setup.sh keeps for the test extra); `make demo` and `make test` do not
# need them, so they do not pay for them.
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
venv=$here/.venv
log() { printf '[docs] %s\n' "$*" >&2; }
[ -x "$venv/bin/python" ] || { log "no venv in $venv: run make setup first"; exit 1; }

stamp=$venv/.aiordma-docs-installed
want=$(sha256sum "$here/pyproject.toml" | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    t0=$(date +%s)
    mapfile -t reqs < <("$venv/bin/python" -c '
import sys, tomllib
extra = tomllib.load(open(sys.argv[1], "rb"))["project"]["optional-dependencies"]["docs"]
print("\n".join(extra))' "$here/pyproject.toml")
    log "installing the docs extra into $venv: ${reqs[*]}"
    "$venv/bin/python" -m pip install -q --disable-pip-version-check "${reqs[@]}" \
        >"$venv/pip-docs.log" 2>&1 \
        || { tail -30 "$venv/pip-docs.log" >&2; log "pip install failed: see $venv/pip-docs.log"; exit 1; }
    echo "$want" > "$stamp"
    # the copy a fresh clone's set-up starts from (scripts/venv_cache.py) gets the docs too
    key=$(cat "$venv/.aiordma-venv-key" 2>/dev/null || true)
    cache=${AIORDMA_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/aiordma}
    if [ -n "$key" ]; then
        "$venv/bin/python" "$here/scripts/venv_cache.py" save "$venv" "$cache" "$key" \
            || log "could not keep a copy of the venv in $cache/venv"
    fi
    log "docs extra installed in $(( $(date +%s) - t0 )) s"
fi

cd "$here"
t0=$(date +%s)
NO_MKDOCS_2_WARNING=1 "$venv/bin/python" -m mkdocs build --strict --quiet
log "site built in build/site in $(( $(date +%s) - t0 )) s"
