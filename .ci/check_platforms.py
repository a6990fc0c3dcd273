"""Whether staticlm's runtime dependencies install from wheels on the platforms that have an NPU (`make
check-platforms`; reaches PyPI, so it is not part of `make test`).

Each dependency of pyproject.toml (the core list and the runtime extras) is asked of pip as a wheel for each
platform and Python version: `pip download --only-binary=:all: --no-deps --platform ... --python-version ...`
(pure-Python wheels count). A requirement whose environment marker leaves it out on a platform is not asked.
Prints the table and exits non-zero when a dependency that a platform needs has no wheel there for some version.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

try:
    from packaging.requirements import Requirement
except ModuleNotFoundError:  # pip vendors it
    from pip._vendor.packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
EXTRAS = ("htp", "app", "serve")  # what a user installs to run; bench and dev are the developers'
PYTHONS = ("3.10", "3.11", "3.12", "3.13")  # requires-python >= 3.10 (README: Python >= 3.10)


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
    # Linux on Snapdragon boards; glibc 2.28 (manylinux_2_28) and older wheels
    Platform("manylinux_aarch64", tuple(f"manylinux_2_{v}_aarch64" for v in range(28, 16, -1)) +
             ("manylinux2014_aarch64",), _LINUX),
    # Apple silicon: no QNN, but the CPU target runs there
    Platform("macosx_arm64", ("macosx_14_0_arm64",), {"sys_platform": "darwin", "platform_system": "Darwin",
                                                      "os_name": "posix", "platform_machine": "arm64"}),
)


def runtime_requirements(pyproject: Path = ROOT / "pyproject.toml") -> list[tuple[str, Requirement]]:
    """(where it is declared: "core" or the extra's name, requirement) for the core list and EXTRAS."""
    project = tomllib.loads(pyproject.read_text())["project"]
    out = [("core", Requirement(r)) for r in project["dependencies"]]
    for extra in EXTRAS:
        out += [(extra, Requirement(r)) for r in project["optional-dependencies"][extra]]
    return out


def pip_has_wheel(requirement: Requirement, platform: Platform, python: str) -> bool:
    """One `pip download` of the requirement's newest matching wheel into a scratch folder."""
    spec = f"{requirement.name}{requirement.specifier}"
    with tempfile.TemporaryDirectory(prefix="staticlm-platforms.") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-deps",
               "--only-binary=:all:", "--implementation", "cp", "--python-version", python, "--dest", tmp,
               *(a for tag in platform.tags for a in ("--platform", tag)), spec]
        return subprocess.run(cmd, capture_output=True, text=True).returncode == 0


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


def check(requirements: list[tuple[str, Requirement]], *, platforms=PLATFORMS, pythons=PYTHONS,
          has_wheel: Callable[[Requirement, Platform, str], bool] = pip_has_wheel) -> dict[str, dict[str, Cell]]:
    """requirement text -> platform name -> Cell."""
    table: dict[str, dict[str, Cell]] = {}
    for where, req in requirements:
        row = table.setdefault(f"{req.name} ({where})", {})
        for platform in platforms:
            needed = tuple(v for v in pythons if req.marker is None or req.marker.evaluate(platform.environment(v)))
            row[platform.name] = Cell(needed, tuple(v for v in needed if not has_wheel(req, platform, v)))
    return table


def format_table(table: dict[str, dict[str, Cell]], platforms=PLATFORMS) -> str:
    names = [p.name for p in platforms]
    lines = ["| dependency | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    lines += [f"| {dep} | " + " | ".join(row[n].text() for n in names) + " |" for dep, row in table.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--python", action="append", default=None, help=f"Python versions (default {', '.join(PYTHONS)})")
    args = p.parse_args(argv)
    table = check(runtime_requirements(), pythons=tuple(args.python or PYTHONS))
    print(format_table(table))
    missing = [f"{dep} on {name}" for dep, row in table.items() for name, cell in row.items() if cell.missing]
    for line in missing:
        print(f"no wheel: {line}", file=sys.stderr)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
