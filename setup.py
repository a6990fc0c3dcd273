"""The kernels library (runtime/kernels) as an optional part of every `pip install`, editable or not: compiled with
the installing user's C compiler (runtime/kernels/build.py) into the package. Without a compiler the install goes on
and says once what the user loses; everything else is declared in pyproject.toml."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

KERNELS = Path(__file__).resolve().parent / "runtime" / "kernels"


def _build_module():
    spec = importlib.util.spec_from_file_location("staticlm_kernels_build", KERNELS / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildKernels(build_ext):
    """Builds the one "extension", the kernels library (a plain shared library ONNX Runtime loads, not a Python
    module), and never fails the install over it."""

    def get_ext_filename(self, fullname: str) -> str:
        return str(Path(*fullname.split(".")[:-1]) / _build_module().LIBRARY_NAME)

    def build_extension(self, ext: Extension) -> None:
        build = _build_module()
        out_dir = Path(self.get_ext_fullpath(ext.name)).parent
        reason = build.build(out_dir, compiler=self.compiler)
        if reason is not None:
            print(f"note: staticlm's GGUF kernels not built: {reason}; {build.LOSS}", file=sys.stderr)

    def run(self) -> None:
        try:
            super().run()
        except Exception as e:  # noqa: BLE001 - no compiler at all (setuptools cannot even make one): install anyway
            build = _build_module()
            reason = f"no C compiler ({' '.join(str(e).split())})"
            build.write_note(Path(self.get_ext_fullpath(self.extensions[0].name)).parent, reason)
            print(f"note: staticlm's GGUF kernels not built: {reason}; {build.LOSS}", file=sys.stderr)


setup(ext_modules=[Extension("staticlm.runtime.kernels.libstaticlm_gguf", sources=[])],
      cmdclass={"build_ext": BuildKernels})
