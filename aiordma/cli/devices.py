"""The device table (``aiordma devices``, ``aiordma rxe status``, the demos)."""

from __future__ import annotations

from typing import Any

__all__ = ["print_devices"]


def print_devices(devs: list[Any]) -> None:
    rows: list[tuple[str, ...]] = [
        ("device", "port", "state", "link", "mtu", "gid", "index", "type", "address")]
    for d in devs:
        for p in d.ports:
            gids = p.gids or (None,)
            for i, g in enumerate(gids):
                head = (d.name, str(p.port), p.state, p.link_layer,
                        f"{p.active_mtu}/{p.max_mtu}") if i == 0 else ("", "", "", "", "")
                if g is None:
                    rows.append(head + ("-", "", "", ""))
                else:
                    where = " ".join(x for x in (g.ip, f"({g.netdev})" if g.netdev else "") if x)
                    rows.append(head + (g.gid, str(g.index), g.type, where))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
