# Two commands on a fresh machine:  `make chat`  and  `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-dev

.PHONY: install chat generate export test test-fast clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip "setuptools>=69"
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

# Exports the embedded default model on first use, then chats with it.
chat: $(STAMP)
	$(BIN)/staticlm chat

generate: $(STAMP)
	$(BIN)/staticlm generate --prompt "What is the capital of France?"

export: $(STAMP)
	$(BIN)/staticlm export

test: $(STAMP)
	$(BIN)/python -m pytest -q

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
