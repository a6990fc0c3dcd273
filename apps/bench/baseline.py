"""`staticlm bench --baseline REV`: staticlm as it was at a git revision, run as one more peer in the same rounds.

A change's "before and after" is then two columns of one run: each round runs this checkout's worker and the
revision's worker one after the other on the same family, so a busy minute on a shared machine hits both alike,
and every row shows the change as a ratio (ours over `staticlm@REV`).

The revision's tree is written once with `git archive` under the peers' cache (`baselines/<commit>/staticlm`) and
its kernels built there with its own build script; its worker runs with that tree first on PYTHONPATH, so `import
staticlm` is the old code while the interpreter and the installed libraries are this environment's. A change that
moved the family's format gives the old code a family it exported itself (`REV=DIR`; export it with that tree on
PYTHONPATH: `PYTHONPATH=<cache>/baselines/<commit> python -m staticlm.apps.cli export ...`).
"""
from __future__ import annotations

import io
import subprocess
import sys
import tarfile
from pathlib import Path

from .base import BenchContext, BenchError
from .peers import PeerModel, PeerUnavailable, peer_cache

REPO = Path(__file__).resolve().parents[2]  # the checkout this staticlm runs from (apps/bench/ is two below)


def _git(*args: str) -> str:
    done = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise BenchError(f"--baseline: git {' '.join(args)} failed in {REPO}: "
                         f"{(done.stderr.strip().splitlines() or ['no output'])[-1][:200]}")
    return done.stdout.strip()


def parse_baseline(text: str) -> tuple[str, Path | None]:
    """`REV` (the revision runs the bench's family) or `REV=DIR` (a family that revision exported, for a change that
    moved the family's format: the old code refuses a newer family). BenchError for a DIR with no family."""
    rev, sep, directory = text.partition("=")
    if not sep:
        return rev, None
    if not (Path(directory) / "manifest.json").is_file():
        raise BenchError(f"--baseline {text}: no exported model at {directory}")
    return rev, Path(directory)


def resolve_revision(rev: str) -> str:
    """The full commit a revision names in this checkout, or BenchError (not a git checkout, unknown revision)."""
    if not (REPO / ".git").exists():
        raise BenchError(f"--baseline needs staticlm run from a git checkout; {REPO} is not one")
    try:
        return _git("rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
    except BenchError:
        raise BenchError(f"--baseline: no commit {rev!r} in {REPO}") from None


def _build_kernels(tree: Path, *, log) -> None:
    """The revision's kernels, built by its own script where it has one (no script: it had no kernels)."""
    build_py, build_sh = tree / "runtime" / "kernels" / "build.py", tree / "runtime" / "kernels" / "build.sh"
    cmd = [sys.executable, str(build_py)] if build_py.is_file() else ["bash", str(build_sh)] if build_sh.is_file() \
        else None
    if cmd is None:
        return
    log(f"  building the kernels of {tree.name} ...")
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=tree)
    if done.returncode != 0:
        raise PeerUnavailable(f"its kernels did not build: {(done.stderr or done.stdout).strip()[-200:]}")


def prepare_baseline(rev: str, *, model_dir: Path, log) -> tuple[str, PeerModel]:
    """The peer's name (`staticlm@<short commit>`) and how to run it. The tree is made once per commit; a tree left
    half-written by an interrupted run is made again (its marker file is written last)."""
    commit = resolve_revision(rev)
    root = peer_cache() / "baselines" / commit
    tree, done_marker = root / "staticlm", root / ".complete"
    if not done_marker.is_file():
        log(f"  writing staticlm at {commit[:9]} (once; cached under {root}) ...")
        archive = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", commit], capture_output=True)
        if archive.returncode != 0:
            raise BenchError(f"--baseline: git archive {commit[:9]} failed")
        tree.mkdir(parents=True, exist_ok=True)
        with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
            tar.extractall(tree, filter="data")
        _build_kernels(tree, log=log)
        done_marker.write_text(commit + "\n")
    name = f"staticlm@{commit[:9]}"
    return name, PeerModel(sys.executable, str(model_dir), worker=tree / "apps" / "bench" / "worker.py",
                           pythonpath=str(root), system="staticlm")


def baseline_systems(ctx: BenchContext) -> dict[str, PeerModel]:
    """{`staticlm@REV`: its worker} for each revision --baseline names (none: {}); a revision that cannot run here
    is a skipped peer with its reason (its tree is made on the first row set that asks)."""
    systems = {}
    for text in ctx.options.baselines:
        rev, model_dir = parse_baseline(text)
        try:
            name, model = prepare_baseline(rev, model_dir=model_dir or ctx.model_dir, log=ctx.log)
        except PeerUnavailable as e:
            ctx.extra.setdefault("skipped_peers", {})[f"staticlm@{rev}"] = str(e)
            continue
        systems[name] = model
    return systems


__all__ = ["baseline_systems", "parse_baseline", "prepare_baseline", "resolve_revision"]
