"""Whether staticlm's runtime dependencies install from wheels on the platforms that have an NPU (`make
check-platforms`; reaches PyPI, so it is not part of `make test`).

The dependencies of pyproject.toml (the core list and the runtime extras) are asked of pip as wheels for each
platform and Python version: `pip download --only-binary=:all: --no-deps --platform ... --python-version ...`
(pure-Python wheels count), all in one call, again without the one pip names as missing until the rest download.
A requirement whose environment marker leaves it out on a platform is not asked.
Prints the table and exits non-zero when a dependency that a platform needs has no wheel there for some version.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import tomllib

try:
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet
    from packaging.utils import canonicalize_name
except ModuleNotFoundError:  # pip vendors it
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.specifiers import SpecifierSet
    from pip._vendor.packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
EXTRAS = ("htp", "app", "serve")  # what a user installs to run; bench and dev are the developers'
CANDIDATE_PYTHONS = ("3.10", "3.11", "3.12", "3.13", "3.14")  # those of them that requires-python admits are checked


@dataclass(frozen=True)
class Platform:
    name: str
    tags: tuple[str, ...]  # pip --platform values (pip widens a macosx tag to the older versions itself)
    markers: dict[str, str]  # PEP 508 environment, less the Python version

    def environment(self, python: str) -> dict[str, str]:
        return {**self.markers, "python_version": python, "python_full_version": f"{python}.0",
                "implementation_name": "cpython", "platform_python_implementation": "CPython"}


_LINUX = {"sys_platform": "linux", "platform_system": "Linux", "os_name": "posix", "platform_machine": "aarch64"}
PLATFORMS = (
    # Snapdragon X laptops
    Platform("win_arm64", ("win_arm64",), {"sys_platform": "win32", "platform_system": "Windows", "os_name": "nt",
                                           "platform_machine": "ARM64"}),
    # Linux on Snapdragon boards: a glibc 2.28 system (manylinux_2_28, and older wheels) and a glibc 2.39 one
    # (Ubuntu 24.04, Debian 13)
    Platform("manylinux_2_28_aarch64", tuple(f"manylinux_2_{v}_aarch64" for v in range(28, 16, -1)) +
             ("manylinux2014_aarch64",), _LINUX),
    Platform("manylinux_2_39_aarch64", tuple(f"manylinux_2_{v}_aarch64" for v in range(39, 16, -1)) +
             ("manylinux2014_aarch64",), _LINUX),
    # Apple silicon: no QNN, but the CPU target runs there
    Platform("macosx_arm64", ("macosx_14_0_arm64",), {"sys_platform": "darwin", "platform_system": "Darwin",
                                                      "os_name": "posix", "platform_machine": "arm64"}),
)


def _project(pyproject: Path) -> dict:
    return tomllib.loads(pyproject.read_text())["project"]


def supported_pythons(pyproject: Path = ROOT / "pyproject.toml") -> tuple[str, ...]:
    """The CANDIDATE_PYTHONS that the project's requires-python admits."""
    admits = SpecifierSet(_project(pyproject)["requires-python"])
    return tuple(v for v in CANDIDATE_PYTHONS if f"{v}.0" in admits)


def runtime_requirements(pyproject: Path = ROOT / "pyproject.toml") -> list[tuple[str, Requirement]]:
    """(where it is declared: "core" or the extra's name, requirement) for the core list and EXTRAS."""
    project = _project(pyproject)
    out = [("core", Requirement(r)) for r in project["dependencies"]]
    for extra in EXTRAS:
        out += [(extra, Requirement(r)) for r in project["optional-dependencies"][extra]]
    return out


def _pip_download(specs: list[str], platform: Platform, python: str) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory(prefix="staticlm-platforms.") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-deps",
               "--only-binary=:all:", "--implementation", "cp", "--python-version", python, "--dest", tmp,
               *(a for tag in platform.tags for a in ("--platform", tag)), *specs]
        return subprocess.run(cmd, capture_output=True, text=True)


def pip_missing(requirements: list[Requirement], platform: Platform, python: str) -> set[str]:
    """The names of the requirements without a wheel: one `pip download` of them all into a scratch folder, again
    without the one pip names as missing until the rest download (or one at a time, if pip's message is not
    understood)."""
    left, missing = list(requirements), set()
    while left:
        done = _pip_download([f"{r.name}{r.specifier}" for r in left], platform, python)
        if done.returncode == 0:
            return missing
        named = re.search(r"No matching distribution found for ([A-Za-z0-9._-]+)", done.stderr)
        culprit = [r for r in left if named and canonicalize_name(r.name) == canonicalize_name(named.group(1))]
        if not culprit:
            return missing | {r.name for r in left if _pip_download([f"{r.name}{r.specifier}"], platform,
                                                                    python).returncode != 0}
        missing.add(culprit[0].name)
        left.remove(culprit[0])
    return missing


@dataclass(frozen=True)
class Cell:
    needed: tuple[str, ...]  # Python versions whose environment the marker lets in
    missing: tuple[str, ...]  # of those, the versions without a wheel

    def text(self) -> str:
        if not self.needed:
            return "not needed"
        if not self.missing:
            return f"yes ({_span(self.needed)})"
        found = [v for v in self.needed if v not in self.missing]
        return f"NO for {_span(self.missing)}" + (f" (yes {_span(found)})" if found else "")


def _span(versions: Iterable[str]) -> str:
    versions = list(versions)
    return versions[0] if len(versions) == 1 else f"{versions[0]}-{versions[-1]}"


def check(requirements: list[tuple[str, Requirement]], *, pythons: tuple[str, ...], platforms=PLATFORMS,
          find_missing: Callable[[list[Requirement], Platform, str], set[str]] = pip_missing
          ) -> dict[str, dict[str, Cell]]:
    """requirement text -> platform name -> Cell; find_missing(requirements, platform, python) -> the names
    without a wheel, asked once per platform and Python version for the requirements its markers let in."""
    needed = {(p.name, v): [r for _w, r in requirements if r.marker is None or r.marker.evaluate(p.environment(v))]
              for p in platforms for v in pythons}
    missing = {(p.name, v): find_missing(needed[p.name, v], p, v) if needed[p.name, v] else set()
               for p in platforms for v in pythons}
    table: dict[str, dict[str, Cell]] = {}
    for where, req in requirements:
        row = table.setdefault(f"{req.name} ({where})", {})
        for p in platforms:
            versions = tuple(v for v in pythons if any(r is req for r in needed[p.name, v]))
            row[p.name] = Cell(versions, tuple(v for v in versions if req.name in missing[p.name, v]))
    return table


def format_table(table: dict[str, dict[str, Cell]], platforms=PLATFORMS) -> str:
    names = [p.name for p in platforms]
    lines = ["| dependency | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    lines += [f"| {dep} | " + " | ".join(row[n].text() for n in names) + " |" for dep, row in table.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--python", action="append", default=None,
                   help="a Python version to check (repeatable; default: those requires-python admits)")
    args = p.parse_args(argv)
    table = check(runtime_requirements(), pythons=tuple(args.python or supported_pythons()))
    print(format_table(table))
    missing = [f"{dep} on {name}" for dep, row in table.items() for name, cell in row.items() if cell.missing]
    for line in missing:
        print(f"no wheel: {line}", file=sys.stderr)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
