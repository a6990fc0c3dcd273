#!/usr/bin/env bash
# ONNX Runtime's own C API header, for the test that checks runtime/kernels/ort_abi.h against it
# (tests/test_kernels_build.py); the kernels themselves never need it. Debian's libonnxruntime-dev (trixie on) is
# downloaded, not installed, into build/ort-header with apt's own client, where root and apt-get are at hand;
# anywhere else this is a no-op and that test says it skipped.
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="$root/build/ort-header"
[ -f "$build/usr/include/onnxruntime/onnxruntime_c_api.h" ] && exit 0
note() { echo "note: no ONNX Runtime header for the ABI check: $*"; exit 0; }
command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ] || note "needs root and apt-get"
# apt's lists and cache for it live under build/ only
mkdir -p "$build/sources" "$build/lists/partial" "$build/cache/archives/partial"
printf 'Types: deb\nURIs: http://deb.debian.org/debian\nSuites: trixie\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
  > "$build/sources/debian.sources"
apt_options=(-o Dir::Etc::SourceList=/dev/null -o Dir::Etc::SourceParts="$build/sources"
             -o Dir::State::Lists="$build/lists" -o Dir::Cache="$build/cache" -o APT::Sandbox::User=root)
apt-get -qq "${apt_options[@]}" update >/dev/null 2>&1 || note "apt-get could not read Debian's package lists"
(cd "$build" && apt-get -qq "${apt_options[@]}" download libonnxruntime-dev >/dev/null 2>&1) \
  || note "apt-get could not download libonnxruntime-dev"
dpkg -x "$build"/libonnxruntime-dev_*.deb "$build" || note "could not unpack libonnxruntime-dev"
