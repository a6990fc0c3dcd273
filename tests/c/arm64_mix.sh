#!/usr/bin/env bash
# The ARM64 dots' instruction counts: tests/c/arm64_mix.c run under qemu-user with one instruction per translated
# block, its executed instructions counted for 1 and 2 passes over a 16 x 1024 matrix; the difference over
# (16 rows x 4 super-blocks of 256 x tile rows) is printed as instructions per 256 weights per activation row.
# Counts, not speed: a device's cycles per instruction decide the rest (README's ARM64 section).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
kernels="$here/../../runtime/kernels"
cc="${ARM64_CC:-aarch64-linux-gnu-gcc}"
qemu="${QEMU_AARCH64:-$(command -v qemu-aarch64 || command -v qemu-aarch64-static)}"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
"$cc" -O3 -std=c11 -D_GNU_SOURCE -static -I"$kernels" "$here/arm64_mix.c" "$kernels/gguf_dot.c" "$kernels"/gguf_neon*.c \
  -o "$out/mix" -lm
count() { "$qemu" -cpu max -singlestep -d exec,nochain -D /dev/stderr "$out/mix" "$@" 2>&1 >/dev/null | grep -c '^Trace'; }
printf '%-6s %-7s %-8s %5s %10s\n' type layout level tile per-256
for spec in Q4_0:2 Q4_1:3 Q5_0:6 Q5_1:7 Q8_0:8 Q4_K:12 Q5_K:13 Q6_K:14; do
  name="${spec%%:*}" type="${spec#*:}"
  for layout in rows groups; do
    for level in dotprod i8mm; do
      for tile in 1 8; do
        [ "$layout" = rows ] && [ "$level" = i8mm ] && continue # the plain rows have no i8mm dots
        one="$(count "$level" "$type" "$layout" "$tile" 1)" || continue
        two="$(count "$level" "$type" "$layout" "$tile" 2)"
        printf '%-6s %-7s %-8s %5d %10.1f\n' "$name" "$layout" "$level" "$tile" "$(echo "($two - $one) / (16 * 4 * $tile)" | bc -l)"
      done
    done
  done
done
