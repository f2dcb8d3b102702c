# Two entry points for a fresh Debian machine with Python >= 3.11:
#   make run   - start the daemon on the default model, stream a chat reply, print TTFT and overhead stats, stop it
#   make test  - install everything the suite needs (HIP compile toolchain included) and run it
#   make wheel - the wheel in dist/, with the kernels' code objects for WHEEL_TARGETS
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PROMPT ?= Write one sentence about the sea.

.PHONY: run test lint venv model wheel

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[dev,cuda,hip]'
	touch $@

venv: $(VENV)/.installed

model: venv
	$(BIN)/rocforge models default

run: model
	$(BIN)/rocforge demo --prompt "$(PROMPT)" --max-tokens 64

test: venv
	bash scripts/install_hip_sdk.sh
	$(BIN)/rocforge models default
	$(BIN)/python -m pytest -q -rfE

lint: venv
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

wheel: venv
	bash scripts/install_hip_sdk.sh
	ROCFORGE_PREBUILT_TARGETS="$$($(BIN)/python -c 'from rocforge_rt.backends import WHEEL_TARGETS; print(",".join(WHEEL_TARGETS))')" \
		$(BIN)/python -m pip wheel --no-deps --no-build-isolation -w dist .
