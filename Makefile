# Two commands do all the set-up on a fresh machine:
#   make demo   - create .venv, install everything, run the demo on CPU
#   make test   - create .venv, install everything, run the whole test suite
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# CPU torch: this wheel is on the CPU machines' disk; never let pip pick a CUDA build here.
TORCH_CPU ?= torch==2.13.0
STAMP  := $(VENV)/.installed

.PHONY: demo test test-thorough soak bench notebooks clean

$(STAMP): pyproject.toml Makefile
	@if $(PYTHON) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then \
	  echo "GPU torch found: reusing it"; $(PYTHON) -m venv --system-site-packages $(VENV); \
	else \
	  $(PYTHON) -m venv $(VENV) && $(PY) -m pip install -q --upgrade pip && $(PY) -m pip install -q "$(TORCH_CPU)"; \
	fi
	$(PY) -m pip install -q -e ".[test,real,megatron,notebooks]"
	@touch $(STAMP)

demo: $(STAMP)
	$(PY) -m taco_triton.demo

test: $(STAMP)
	$(PY) -m pytest -q --timeout=900

test-thorough: $(STAMP)
	HYPOTHESIS_PROFILE=thorough $(PY) -m pytest -q --timeout=1800

# the randomized collectives soak, long: 2000 collectives on 3 gloo ranks (CI runs 100)
soak: $(STAMP)
	SOAK_OPS=$${SOAK_OPS:-2000} $(PY) -m pytest -q --timeout=7200 tests/test_collectives.py -k soak

notebooks: $(STAMP)
	$(PY) notebooks/run_all.py

bench: $(STAMP)
	$(PY) bench/kernels.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
