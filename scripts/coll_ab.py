"""A/B of the collectives between checkouts in one VM boot, interleaved: ``python
scripts/coll_ab.py OUT CHECKOUT... [--rounds 2] [--sizes 65536,1048576] [--worlds 2,4]
[--calls 15] [--profile 20]`` (in the VM: under ``python -m harness run``; each checkout with
its own ``.venv`` set up and precompiled).

Round by round, checkout by checkout (A B A B ...), for each world size it launches area (h)'s
own worker (``aiordma.bench.collective_worker``, uvloop, allreduce only, the sizes given) with
that checkout's interpreter, and merges the ranks' call times as the bench does (a call's time
is the slowest rank's; median of the calls, with the fastest and slowest); then, with
``--profile N``, ``scripts/coll_profile.py`` (this checkout's, for every checkout) of the first
size (N calls timed per rank, N counted, N more under cProfile) and keeps rank 0's summary
line. Everything is printed and written to
``OUT/ab.json``; the profiles stay in ``OUT/<round>-<checkout name>/``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

LAUNCH_TIMEOUT = 900  # one launch (the group's own waits are bounded at 120 s each)


def _launch(checkout: Path, world: int, argv: list[str]) -> tuple[int, str]:
    py = str(checkout / ".venv" / "bin" / "python")
    cmd = [py, "-m", "aiordma.services.collectives.launch", "-n", str(world), "--", py, *argv]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    p = subprocess.run(cmd, check=False, cwd=checkout, env=env, capture_output=True, text=True,
                       timeout=LAUNCH_TIMEOUT)
    return p.returncode, (p.stdout + p.stderr)[-2000:]


def _bench(checkout: Path, world: int, sizes: str, calls: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="coll-ab-") as d:
        rc, out = _launch(checkout, world, ["-m", "aiordma.bench.collective_worker", "--out", d,
                                            "--sizes", sizes, "--collectives", "allreduce",
                                            "--loops", "uvloop", "--calls", str(calls)])
        docs = [json.loads(Path(d, f"rank-{r}.json").read_text()) for r in range(world)
                if Path(d, f"rank-{r}.json").exists()]
    rows: dict[str, Any] = {}
    if len(docs) != world:
        return {"error": f"launcher status {rc}, {len(docs)} rank files: {out}"}
    for nbytes in sizes.split(","):
        per_rank = []
        for doc in docs:
            run = doc["runs"]["uvloop"]
            case = next((c for c in run["cases"] if c["bytes"] == int(nbytes)), None)
            if run["error"] or case is None or case["error"]:
                per_rank = []
                rows[nbytes] = {"error": run["error"] or (case or {}).get("error")}
                break
            per_rank.append(case["times"])
        if per_rank:
            slowest = [max(t) * 1e3 for t in zip(*per_rank, strict=True)]
            rows[nbytes] = {"median": statistics.median(slowest), "min": min(slowest),
                            "max": max(slowest), "calls": len(slowest)}
    return rows


def _profile(checkout: Path, world: int, nbytes: int, calls: int, out: Path) -> str:
    out.mkdir(parents=True, exist_ok=True)
    script = Path(__file__).resolve().parent / "coll_profile.py"  # (this one: public API only)
    rc, text = _launch(checkout, world, [str(script), str(nbytes), str(calls),
                                         str(out.resolve())])
    f = out / f"prof-{nbytes}-{world}-0.txt"
    if rc or not f.exists():
        return f"failed: status {rc}: {text}"
    return f.read_text().splitlines()[0]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("out")
    p.add_argument("checkouts", nargs="+")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--sizes", default="65536,1048576")
    p.add_argument("--worlds", default="2,4")
    p.add_argument("--calls", type=int, default=15)
    p.add_argument("--profile", type=int, default=20, help="coll_profile calls (0: none)")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    results: list[dict[str, Any]] = []
    for rnd in range(a.rounds):
        for c in a.checkouts:
            checkout = Path(c).resolve()
            name = checkout.name
            for world in (int(w) for w in a.worlds.split(",")):
                t0 = time.time()
                rows = _bench(checkout, world, a.sizes, a.calls)
                prof = ""
                if a.profile:
                    first = int(a.sizes.split(",")[0])
                    prof = _profile(checkout, world, first, a.profile,
                                    out / f"{rnd}-{name}")
                entry = {"round": rnd, "checkout": name, "world": world, "rows": rows,
                         "profile": prof, "started": t0, "took": time.time() - t0}
                results.append(entry)
                print(json.dumps(entry), flush=True)
                (out / "ab.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
