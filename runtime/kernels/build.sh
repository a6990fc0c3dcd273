#!/usr/bin/env bash
# Builds libstaticlm_gguf.so beside this script (build.py): ONNX Runtime custom ops over GGUF blocks and staticlm's
# KV buffers. A C compiler is all it needs (no ORT header, no root); without one it says so and exits 0, and families
# are exported with ORT's MatMulNBits instead (staticlm.runtime.kernels).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
exec "${PYTHON:-python3}" "$here/build.py"
