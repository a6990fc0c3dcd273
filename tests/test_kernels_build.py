"""The kernels library builds with a C compiler alone (runtime/kernels/build.py): no ORT header, no apt, no root;
its own declarations of ORT's C ABI (ort_abi.h) sit where ORT's header puts them; and a library that cannot run here
(another CPU's build, an ONNX Runtime older than its C API needs) is refused in one line before it is loaded."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from staticlm.runtime import kernels
from staticlm.runtime.kernels import build

KERNELS = Path(kernels.__file__).parent
REPO = KERNELS.parent.parent
CC = shutil.which(os.environ.get("CC", "cc"))
needs_cc = pytest.mark.skipif(CC is None, reason="no C compiler on this machine")


def ort_header() -> Path | None:
    for folder in (os.environ.get("ORT_INCLUDE"), REPO / "build/ort-header/usr/include/onnxruntime",
                   "/usr/include/onnxruntime"):
        if folder and (Path(folder) / "onnxruntime_c_api.h").is_file():
            return Path(folder)
    return None


def declared_members(struct: str) -> list[str]:
    """The named members of one of ort_abi.h's structs (its unnamed slots left out)."""
    text = (KERNELS / "ort_abi.h").read_text()
    body = re.search(r"struct " + struct + r" \{(.*?)\n\}", text, re.S).group(1)
    return re.findall(r"\(ORT_API_CALL\* (\w+)\)", body) + re.findall(r"^  uint32_t (\w+);", body, re.M)


def layout_program(header: str) -> str:
    """C that prints every declared member's offset and every declared constant's value, with `header`'s types."""
    lines = [f'printf("{s}.{m} %zu\\n", offsetof({s}, {m}));'
             for s, t in (("OrtApi", "OrtApi"), ("OrtApiBase", "OrtApiBase"), ("struct OrtCustomOp", "OrtCustomOp"))
             for m in declared_members(t)]
    constants = sorted(set(re.findall(r"\b(ORT_(?:OK|FAIL|INVALID_ARGUMENT)|ONNX_TENSOR_ELEMENT_DATA_TYPE_\w+|"
                                      r"OrtMemTypeDefault|INPUT_OUTPUT_\w+)\b", (KERNELS / "ort_abi.h").read_text())))
    lines += [f'printf("{c} %d\\n", (int){c});' for c in constants]
    return (f"#include <{header}>\n#include <stddef.h>\n#include <stdio.h>\nint main(void) {{\n  "
            + "\n  ".join(lines) + "\n  return 0;\n}\n")


def run_layout(tmp: Path, header: str, include: Path) -> str:
    source, program = tmp / f"{Path(header).stem}.c", tmp / Path(header).stem
    source.write_text(layout_program(header))
    subprocess.run([CC, "-std=c11", "-I", str(include), str(source), "-o", str(program)], check=True)
    return subprocess.run([str(program)], check=True, capture_output=True, text=True).stdout


@needs_cc
def test_our_declarations_of_orts_abi_sit_where_orts_own_header_puts_them(tmp_path):
    header = ort_header()
    if header is None:
        pytest.skip("ONNX Runtime's onnxruntime_c_api.h is not here (`make ort-header` fetches it as root)")
    ours, theirs = run_layout(tmp_path, "ort_abi.h", KERNELS), run_layout(tmp_path, "onnxruntime_c_api.h", header)
    assert "OrtApi.KernelContext_ParallelFor 2192" in ours  # entry 274, every member compared below
    assert ours == theirs
    version = int(re.search(r"#define ORT_API_VERSION (\d+)", (header / "onnxruntime_c_api.h").read_text()).group(1))
    assert version >= int(re.search(r"#define ORT_API_NEEDED (\d+)", (KERNELS / "ort_abi.h").read_text()).group(1))


def test_no_source_needs_orts_header_and_the_build_has_no_apt_path():
    for source in KERNELS.glob("*.[ch]"):
        assert "onnxruntime_c_api.h>" not in source.read_text(), source.name
    assert "apt" not in (KERNELS / "build.sh").read_text() + (KERNELS / "build.py").read_text()


def as_user(argv: list[str]) -> list[str]:
    """argv run as a user without root (nobody) where we are root, as a user installs; else as ourselves."""
    runuser = shutil.which("runuser")
    return [runuser, "-u", "nobody", "--", *argv] if os.geteuid() == 0 and runuser else argv


def user_python() -> str:
    """A Python with setuptools that as_user() can run (root's own may sit where nobody can read)."""
    for python in (sys.executable, shutil.which("python3"), shutil.which("python3", path=os.defpath)):
        if python and subprocess.run(as_user([python, "-c", "import setuptools"]), capture_output=True).returncode == 0:
            return python
    pytest.skip("no Python with setuptools that a user without root can run")


@needs_cc
def test_the_library_builds_as_a_user_without_apt_or_an_ort_header_and_its_ops_pass():
    """A copy of the sources built by a non-root user whose PATH has a compiler and Python but no apt-get, then the
    ops' own tests (bit-exact against gguf's dequantization) run on that library."""
    with tempfile.TemporaryDirectory() as tmp:  # not pytest's tmp_path: a folder only root may enter
        built_by_user(Path(tmp))


def built_by_user(tmp: Path) -> None:
    os.chmod(tmp, 0o777)
    sources = tmp / "kernels"
    shutil.copytree(KERNELS, sources, ignore=shutil.ignore_patterns("*.so", ".build-note", "__pycache__"))
    os.chmod(sources, 0o777)
    tools = tmp / "bin"
    tools.mkdir()
    for tool in ("cc", "gcc", "as", "ld"):
        if found := shutil.which(tool):
            (tools / tool).symlink_to(found)
    env = {"PATH": str(tools), "HOME": str(tmp), "LANG": "C.UTF-8"}
    assert shutil.which("apt-get", path=env["PATH"]) is None
    result = subprocess.run(as_user([user_python(), str(sources / "build.py")]), env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0 and "built" in result.stdout, result.stdout + result.stderr
    library = sources / build.LIBRARY_NAME
    assert kernels.read_target(library) is not None
    env = {**os.environ, "STATICLM_KERNELS_LIBRARY": str(library), "STATICLM_HOME": str(tmp / "home")}
    tests = [str(REPO / "tests" / name) for name in ("test_gguf_kernels.py", "test_attention_op.py")]
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", *tests],
                            env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert result.returncode == 0, result.stdout[-3000:]
    assert re.search(r"^\d+ passed in", result.stdout, re.M), result.stdout[-3000:]  # nothing skipped or failed


def test_without_a_compiler_the_build_says_why_and_leaves_no_library(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    reason = build.build(tmp_path)
    assert reason is not None and "no working C compiler" in reason
    assert not (tmp_path / build.LIBRARY_NAME).exists()
    assert (tmp_path / build.NOTE_NAME).read_text().strip() == reason


# ---- bad input: a library that cannot run here is refused in one line, before it is loaded ---------------------

def one_line_refusal(monkeypatch, match: str) -> None:
    from staticlm.export.options import ExportRequest

    assert not kernels.available()
    with pytest.raises(kernels.KernelsMissing, match=match) as e:
        kernels.check_family((kernels.DOMAIN,))
    assert "\n" not in str(e.value) and "--gguf-kernels off" in str(e.value)
    assert ExportRequest(target="cpu").cpu_options().gguf_kernels is False  # MatMulNBits instead

    def loaded(*_args):
        raise AssertionError("a refused library must not be loaded")
    options = type("Options", (), {"register_custom_ops_library": loaded})()
    kernels.register(options)


def test_a_library_built_for_another_architecture_is_refused(monkeypatch, tmp_path):
    if not kernels.LIBRARY.is_file():
        pytest.skip(kernels.why_missing())
    other = {"x86_64": b"aarch64", "aarch64": b"x86_64"}.get(kernels.machine(), b"x86_64")
    data = kernels.LIBRARY.read_bytes()
    at = data.index(kernels.TARGET_MARK) + len(kernels.TARGET_MARK)
    copied = tmp_path / build.LIBRARY_NAME
    copied.write_bytes(data[:at] + other + data[data.index(b":", at):])
    monkeypatch.setattr(kernels, "LIBRARY", copied)
    one_line_refusal(monkeypatch, f"built for {other.decode()}, this CPU is {kernels.machine()}: build them with")


@needs_cc
def test_a_library_compiled_for_cpu_features_this_one_lacks_is_refused(monkeypatch, tmp_path):
    """-march style flags leak instructions into the portable code: the library records them, and a CPU without
    them refuses it (here: a real build with -mavx2 -mfma, on a CPU said to have neither)."""
    if kernels.machine() != "x86_64":
        pytest.skip("the flags compiled in are x86's")
    monkeypatch.setenv("CC", f"{CC} -mavx2 -mfma")
    assert build.build(tmp_path) is None
    arch, flags, _api = kernels.read_target(tmp_path / build.LIBRARY_NAME)
    assert arch == "x86_64" and {"avx2", "fma"} <= flags
    monkeypatch.setattr(kernels, "LIBRARY", tmp_path / build.LIBRARY_NAME)
    monkeypatch.setattr(kernels, "cpu_features", lambda: frozenset({"sse2", "ssse3"}))
    one_line_refusal(monkeypatch, r"built for a CPU with avx, avx2, fma, sse4_2, which this one lacks")


def test_the_projects_own_build_takes_no_cpu_feature_for_granted():
    """No -march leaks into the portable code: AVX2 and the other vector dots are chosen at run time."""
    if not kernels.LIBRARY.is_file():
        pytest.skip(kernels.why_missing())
    arch, flags, api = kernels.read_target(kernels.LIBRARY)
    assert (arch, flags) == (kernels.machine(), frozenset())
    assert api == 17


def test_an_onnx_runtime_older_than_the_ops_c_api_is_refused(monkeypatch):
    if not kernels.LIBRARY.is_file():
        pytest.skip(kernels.why_missing())
    monkeypatch.setattr(kernels.ort, "__version__", "1.16.3")
    one_line_refusal(monkeypatch, r"need ONNX Runtime's C API version 17 \(onnxruntime 1.17 or later\), this is "
                                  r"onnxruntime 1.16.3: upgrade it \(pip install -U onnxruntime\); or re-export")


OLD_API_TABLE = """
import ctypes, sys
said = []
create_status = ctypes.CFUNCTYPE(ctypes.c_size_t, ctypes.c_int, ctypes.c_char_p)(
    lambda code, message: said.append(message) or 0x5)
table = (ctypes.c_void_p * 300)()
table[0] = ctypes.cast(create_status, ctypes.c_void_p)
get_api = ctypes.CFUNCTYPE(ctypes.c_size_t, ctypes.c_uint32)(
    lambda version: ctypes.addressof(table) if version <= 16 else 0)
version = ctypes.create_string_buffer(b"1.16.3")
version_string = ctypes.CFUNCTYPE(ctypes.c_size_t)(lambda: ctypes.addressof(version))
base = (ctypes.c_void_p * 2)(ctypes.cast(get_api, ctypes.c_void_p), ctypes.cast(version_string, ctypes.c_void_p))
library = ctypes.CDLL(sys.argv[1])
library.RegisterCustomOps.restype = ctypes.c_void_p
library.RegisterCustomOps.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
print(library.RegisterCustomOps(None, ctypes.addressof(base)))
print(said[0].decode() if said else "")
"""


def test_the_library_declines_an_old_api_table_with_a_status_not_a_crash():
    """RegisterCustomOps handed an OrtApiBase whose runtime has no version 17 table (a stand-in for ORT 1.16, built
    with ctypes) returns a status saying which version it needs, made through version 1's table. In a process of
    its own: a process that already registered the library with ONNX Runtime holds its real API table."""
    if not kernels.available():
        pytest.skip(kernels.why_missing())
    proc = subprocess.run([sys.executable, "-c", OLD_API_TABLE, str(kernels.LIBRARY)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [str(0x5), "staticlm's kernels need ONNX Runtime's C API version 17 (ONNX "
                                        "Runtime 1.17 or later); this is ONNX Runtime 1.16.3"]


GNU_ONLY = re.compile(r"__attribute__|__builtin_|__declspec|\b__thread\b|__asm__")
COMPILER_GUARDS = ("__GNUC__", "__clang__", "_MSC_VER", "_WIN32")


def test_compiler_specific_words_stand_only_under_a_compiler_guard():
    """The C builds with GCC, Clang, clang-cl and MSVC alike (README, Kernels): a GNU or MSVC word outside an #if on
    the compiler would stop one of them."""
    unguarded = []
    for source in sorted(KERNELS.glob("*.[ch]")):
        conditions: list[str] = []
        for number, line in enumerate(source.read_text().splitlines(), 1):
            directive = line.strip()
            if directive.startswith("#if"):
                conditions.append(directive)
            elif directive.startswith("#endif"):
                conditions.pop()
            elif directive.startswith("#define") and GNU_ONLY.search(line) and not conditions:
                unguarded.append(f"{source.name}:{number}")
            elif GNU_ONLY.search(line.split("//")[0]) and not directive.startswith("#"):
                if not any(guard in c for c in conditions for guard in COMPILER_GUARDS):
                    unguarded.append(f"{source.name}:{number}")
    assert unguarded == []


def test_an_export_where_the_kernels_are_missing_says_once_what_it_loses(monkeypatch, tmp_path, capsys):
    from staticlm.export.options import ExportRequest

    monkeypatch.setattr(kernels, "LIBRARY", tmp_path / build.LIBRARY_NAME)
    monkeypatch.setattr(kernels, "_noted", False)
    for _ in range(2):
        assert ExportRequest(target="cpu").cpu_options().gguf_kernels is False
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and "MatMulNBits" in said[0] and "python -m staticlm.runtime.kernels" in said[0]
    ExportRequest(target="cpu", gguf_kernels="off").cpu_options()  # asked for: nothing more to say
    assert capsys.readouterr().err == ""


@needs_cc
def test_a_flag_for_one_source_stays_out_of_the_record(monkeypatch, tmp_path):
    """SOURCE_FLAGS (a vector dot file compiled for a CPU feature it checks for at run time) reach that file alone:
    the record, compiled in ops_register.c, still takes no CPU feature for granted."""
    if kernels.machine() != "x86_64":
        pytest.skip("the flag is x86's")
    monkeypatch.setitem(build.SOURCE_FLAGS, "gguf_avx2.c", ["-mavx2", "-mfma", "-mf16c"])
    assert build.build(tmp_path) is None
    assert kernels.read_target(tmp_path / build.LIBRARY_NAME)[1] == frozenset()


C11_CHECK = ["-std=c11", "-D_GNU_SOURCE", "-pedantic-errors", "-Werror=vla", "-Wall", "-Werror", "-fsyntax-only"]


@needs_cc
@pytest.mark.parametrize("compiler", [CC, "aarch64-linux-gnu-gcc"])
def test_the_c_is_iso_c11_without_arrays_of_run_time_length(compiler):
    """MSVC has no variable-length arrays (C11 made them optional) and no GNU extensions: every source must be ISO
    C11 as GCC's -pedantic-errors reads it, on x86-64 and (where Debian's cross compiler is installed, `make
    arm64-cross`) ARM64, whose NEON files are compiled only there."""
    if shutil.which(compiler) is None:
        pytest.skip(f"no {compiler} on this machine (Debian's gcc-aarch64-linux-gnu)")
    failed = {}
    for source in build.sources():
        done = subprocess.run([compiler, *C11_CHECK, "-I", str(KERNELS), str(source)], capture_output=True, text=True)
        if done.returncode:
            failed[source.name] = done.stderr.strip().splitlines()[:3]
    assert failed == {}


def test_msvc_and_clang_cl_get_c11_and_avx2_only_where_the_cpu_was_checked():
    """build.py's flags for MSVC and clang-cl (CI runs neither): C11, and /arch:AVX2 on the x86-64 files that run
    only after have_avx2() (never gguf_avx2.c, which asks it, nor a file with a portable path); on ARM64 none."""
    assert "/std:c11" in build.MSVC_FLAGS and not [f for f in build.MSVC_FLAGS if f.startswith("-")]
    names = [source.name for source in build.sources()]
    avx2 = {n for n in names if build.source_flags(n, msvc=True, machine="AMD64") == ["/arch:AVX2"]}
    assert avx2 == {"gguf_avx2_group.c", "gguf_avx2_one.c", "gguf_avx2_tile.c"}
    assert all(build.source_flags(n, msvc=True, machine="ARM64") == [] for n in names)
    assert all(not build.source_flags(n, msvc=True, machine="AMD64") for n in names if n not in avx2)
