#!/usr/bin/env bash
# Builds libstaticlm_gguf.so, ONNX Runtime custom ops over GGUF blocks (gguf_ops.c) and staticlm's KV buffers
# (attention_ops.c), next to this script.
# The ops need ONNX Runtime's C API header, which its Python wheel does not ship: it is taken from $ORT_INCLUDE,
# the system (/usr/include/onnxruntime), or Debian's libonnxruntime-dev package, downloaded (not installed) into
# build/ with apt's own client where apt-get and root are at hand. Without a header or a C compiler this prints
# why and exits 0: families are then exported with ORT's MatMulNBits instead (staticlm.runtime.kernels).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
out="$here/libstaticlm_gguf.so"
build="$root/build/ort-header"
note() { echo "note: GGUF kernels not built: $*"; rm -f "$here/.build-note"; echo "$*" > "$here/.build-note"; exit 0; }

include=""
for dir in "${ORT_INCLUDE:-}" "$build/usr/include/onnxruntime" /usr/include/onnxruntime; do
  if [ -n "$dir" ] && [ -f "$dir/onnxruntime_c_api.h" ]; then include="$dir"; break; fi
done
if [ -z "$include" ]; then
  command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ] || note "no onnxruntime_c_api.h (set ORT_INCLUDE, or run as root with apt-get)"
  # libonnxruntime-dev is in Debian from trixie on; apt's lists and cache for it live under build/ only
  mkdir -p "$build/sources" "$build/lists/partial" "$build/cache/archives/partial"
  printf 'Types: deb\nURIs: http://deb.debian.org/debian\nSuites: trixie\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
    > "$build/sources/debian.sources"
  apt_options=(-o Dir::Etc::SourceList=/dev/null -o Dir::Etc::SourceParts="$build/sources"
               -o Dir::State::Lists="$build/lists" -o Dir::Cache="$build/cache" -o APT::Sandbox::User=root)
  apt-get -qq "${apt_options[@]}" update >/dev/null 2>&1 || note "apt-get could not read Debian's package lists"
  (cd "$build" && apt-get -qq "${apt_options[@]}" download libonnxruntime-dev >/dev/null 2>&1) \
    || note "apt-get could not download libonnxruntime-dev"
  dpkg -x "$build"/libonnxruntime-dev_*.deb "$build" || note "could not unpack libonnxruntime-dev"
  include="$build/usr/include/onnxruntime"
  [ -f "$include/onnxruntime_c_api.h" ] || note "libonnxruntime-dev has no onnxruntime_c_api.h"
fi
cc="${CC:-cc}"
command -v "$cc" >/dev/null 2>&1 || note "no C compiler ($cc)"
"$cc" -O3 -std=c11 -D_GNU_SOURCE -fPIC -shared -fvisibility=hidden -Wall -Wextra -Werror \
  -I"$include" "$here"/*.c -o "$out.tmp" -lpthread -lm
mv "$out.tmp" "$out"
rm -f "$here/.build-note"
echo "built $out"
