# Two commands on a fresh machine:  `make chat`  and  `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-dev

.PHONY: install kernels ort-header xvfb arm64-cross chat generate export test test-fast lint check-platforms clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip "setuptools>=69"
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

# staticlm's ONNX Runtime kernels over GGUF blocks (runtime/kernels): `pip install` builds them (setup.py), and this
# rebuilds them after their sources change. A C compiler is all they need; without one build.sh says why, and
# families use ORT's MatMulNBits instead.
KERNELS := runtime/kernels/libstaticlm_gguf.so
$(KERNELS): $(wildcard runtime/kernels/*.c runtime/kernels/*.h) runtime/kernels/build.sh runtime/kernels/build.py | $(STAMP)
	@PYTHON=$(BIN)/python bash runtime/kernels/build.sh

kernels: $(KERNELS)

# ONNX Runtime's C header, only for the test that checks the kernels' own declarations of its ABI against it.
ort-header:
	@bash .ci/ort_header.sh

# $(call apt_install,PACKAGES,WHAT IS LOST): the packages where we can install them (root with apt-get), once;
# anywhere else one note saying what is lost.
define apt_install
@if command -v dpkg >/dev/null 2>&1 && dpkg -s $(1) >/dev/null 2>&1; then :; \
elif command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	(export DEBIAN_FRONTEND=noninteractive; apt-get install -y -qq $(1) >/dev/null \
		|| (apt-get update -qq && apt-get install -y -qq $(1) >/dev/null)) \
		|| echo "note: could not install $(1); $(2)"; \
else echo "note: $(1) not installed (needs root and apt-get); $(2)"; fi
endef

# The GUI screenshot test runs under Xvfb: Debian's xvfb plus the X libraries Qt's xcb plugin loads, installed
# only where we can (root with apt-get); anywhere else this is a no-op and the test grabs the window offscreen.
XVFB_PACKAGES := xvfb xauth libxcb-cursor0 libxcb-icccm4 libxcb-keysyms1 libxcb-image0 libxcb-render-util0 \
                 libxcb-shape0 libxcb-xkb1 libxcb-randr0 libxcb-xinerama0 libxkbcommon-x11-0 libegl1 libgl1 \
                 libfontconfig1 libdbus-1-3 fonts-dejavu-core
xvfb:
	$(call apt_install,$(XVFB_PACKAGES),the screenshot test will grab offscreen)

# The ARM64 dots' test (tests/test_arm64_dots.py) cross-compiles them and runs them under qemu-user: Debian's cross
# compiler, its C library and qemu-user, installed only where we can (root with apt-get); elsewhere the test skips.
ARM64_PACKAGES := gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user
arm64-cross:
	$(call apt_install,$(ARM64_PACKAGES),the ARM64 dots' test will skip)

# Exports the embedded default model on first use, then opens the chat window (the terminal chat without a display).
chat: $(STAMP) $(KERNELS)
	$(BIN)/staticlm app

generate: $(STAMP) $(KERNELS)
	$(BIN)/staticlm generate --prompt "What is the capital of France?"

export: $(STAMP) $(KERNELS)
	$(BIN)/staticlm export

# One pytest-xdist worker per core, a file at a time (tests/conftest.py keeps the files that share an expensive
# fixture together) and the heaviest first (--no-loadscope-reorder).
PYTEST := $(BIN)/python -m pytest -q -n auto --dist loadfile --no-loadscope-reorder

test: $(STAMP) $(KERNELS) xvfb ort-header arm64-cross
	$(BIN)/ruff check .
	$(PYTEST)

test-fast: $(STAMP) $(KERNELS)
	$(BIN)/ruff check .
	$(PYTEST) -m "not slow"

lint: $(STAMP)
	$(BIN)/ruff check .

# Whether every runtime dependency has a wheel for Windows on ARM64, Linux aarch64 (glibc 2.28 and 2.39) and macOS
# arm64 at each Python version requires-python admits (asks PyPI through pip, so it is not part of `make test`).
check-platforms: $(STAMP)
	$(BIN)/python .ci/check_platforms.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis $(KERNELS)
