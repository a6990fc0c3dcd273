#!/usr/bin/env bash
# Cross-compiles the ARM64 dots (runtime/kernels: gguf_dot.c and gguf_neon*.c, no ONNX Runtime) with
# tests/c/test_arm64_dots.c for aarch64, statically, and runs the test under qemu-user on three CPU models: one with
# i8mm and the dot products (max), one with the dot products only (cortex-a76), one with neither (cortex-a57), each
# told which level the run-time choice must take there.
# Arguments are passed to the compiler (tests/test_arm64_dots.py breaks one dot with -DSTATICLM_BREAK_DOT=<type>).
# Needs Debian's gcc-aarch64-linux-gnu, libc6-dev-arm64-cross and qemu-user (`make arm64-cross` installs them);
# exits 3 saying what is missing otherwise.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
kernels="$root/runtime/kernels"
cc="${ARM64_CC:-aarch64-linux-gnu-gcc}"
qemu="${QEMU_AARCH64:-}"
if [ -z "$qemu" ]; then
  for candidate in qemu-aarch64 qemu-aarch64-static; do
    if command -v "$candidate" >/dev/null 2>&1; then qemu="$candidate"; break; fi
  done
fi
command -v "$cc" >/dev/null 2>&1 || { echo "missing: $cc (Debian's gcc-aarch64-linux-gnu)"; exit 3; }
[ -n "$qemu" ] || { echo "missing: qemu-aarch64 (Debian's qemu-user)"; exit 3; }
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
# the library's own flags (build.sh), statically linked so that qemu needs no ARM64 libraries at run time
"$cc" -O3 -std=c11 -D_GNU_SOURCE -Wall -Wextra -Werror -static -I"$kernels" "$@" "$here/test_arm64_dots.c" \
  "$kernels/gguf_dot.c" "$kernels"/gguf_neon*.c -o "$out/test_arm64_dots" -lm
status=0
run() { # cpu, the level it must take, [STATICLM_ARM_DOTS]
  echo "== qemu -cpu $1 (expects $2${3:+, STATICLM_ARM_DOTS=$3})"
  STATICLM_ARM_DOTS="${3:-}" "$qemu" -cpu "$1" "$out/test_arm64_dots" "$2" || status=1
}
run max i8mm
run cortex-a76 dotprod
run cortex-a57 portable
run max dotprod dotprod # the environment lowers the level
exit "$status"
