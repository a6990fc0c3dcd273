"""Where a process's memory is: PSS and RSS per mapped file (anonymous memory as one entry), from /proc/PID/smaps.

smaps_rollup gives the total; this says which file's pages make it (weights.bin, packed.bin, a GGUF, the
libraries), so a copy held twice shows as two names.

    python -m staticlm.apps.bench.mappings PID [--top N]
"""
from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass

ANON = "[anon]"
_HEADER = re.compile(r"^[0-9a-f]+-[0-9a-f]+ ")


@dataclass
class Mapped:
    pss: int = 0  # bytes
    rss: int = 0
    size: int = 0  # mapped (virtual) bytes


def _name(header: str) -> str:
    """The mapped file of an smaps header line (address perms offset dev inode [path]), else ANON."""
    parts = header.split(maxsplit=5)
    if len(parts) < 6 or not parts[5].strip():
        return ANON
    path = parts[5].strip()
    return ANON if path.startswith("[anon") else path


def by_mapping(pid: int) -> dict[str, Mapped]:
    """PSS, RSS and size per mapped file of pid (every mapping of one file summed), largest PSS first."""
    out: dict[str, Mapped] = {}
    current = None
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            if _HEADER.match(line):
                current = out.setdefault(_name(line), Mapped())
                continue
            key, _, rest = line.partition(":")
            if current is None:
                continue
            if key == "Pss":
                current.pss += int(rest.split()[0]) * 1024
            elif key == "Rss":
                current.rss += int(rest.split()[0]) * 1024
            elif key == "Size":
                current.size += int(rest.split()[0]) * 1024
    return dict(sorted(out.items(), key=lambda kv: -kv[1].pss))


def summary(mapped: dict[str, Mapped], *, top: int = 8) -> dict[str, int]:
    """The top entries' PSS by short name (the file's last two path parts), the rest as one entry."""
    items = list(mapped.items())
    out = {_short(name): m.pss for name, m in items[:top]}
    rest = sum(m.pss for _name, m in items[top:])
    if rest:
        out["(the rest)"] = rest
    return out


def _short(name: str) -> str:
    """A file's last two path parts; "[heap]" and the like without brackets (rich reads brackets as markup)."""
    return "/".join(name.split("/")[-2:]).strip("[]")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pid", type=int)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args(argv)
    mapped = by_mapping(args.pid)
    print(f"{'PSS MB':>9} {'RSS MB':>9} {'size MB':>9}  mapping")
    for name, m in list(mapped.items())[:args.top]:
        print(f"{m.pss / 1e6:9.1f} {m.rss / 1e6:9.1f} {m.size / 1e6:9.1f}  {name}")
    print(f"{sum(m.pss for m in mapped.values()) / 1e6:9.1f} {sum(m.rss for m in mapped.values()) / 1e6:9.1f}"
          f" {'':9}  total")
    return 0


if __name__ == "__main__":
    sys.exit(main())
