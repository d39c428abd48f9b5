# Two commands do all the set-up on a fresh machine:
#   make demo   - create .venv, install everything, run the demo on CPU
#   make test   - create .venv, install everything, run the whole test suite
# and one checks the package as a user receives it:
#   make wheel-check - build the wheel, install it into a fresh venv outside the source tree, use it
# For contributors (they add the docs and lint tools to the same .venv):
#   make docs   - build the documentation site into site/ (mkdocs --strict: a broken link fails)
#   make lint   - ruff check on the whole repository
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
DOCS_STAMP := $(VENV)/.docs-installed
DIST   := dist
# PyTorch's CPU-only build. PyPI's Linux torch wheel depends on the nvidia-*-cu13 packages (gigabytes),
# so torch itself comes from PyTorch's CPU index, or from a CPU wheel pip already finds locally
# (its find-links or extra indexes); only torch's small pure-Python dependencies come from the default index.
TORCH_VERSION   ?= 2.13.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
WHEEL_VENV      ?= /tmp/taco-triton-wheel-check

.PHONY: demo test test-thorough test-torch-base soak bench notebooks docs docs-serve lint wheel wheel-check clean

# $(call install_cpu_torch,PYTHON): an unreachable CPU index fails within seconds (no retries), and pip
# then uses whatever CPU wheel it finds locally; with neither, stop rather than fetch a CUDA build.
define install_cpu_torch
	$(1) -m pip install -q --upgrade pip
	$(1) -m pip install -q --no-deps --retries 0 --timeout 15 --index-url $(TORCH_CPU_INDEX) "torch==$(TORCH_VERSION)" \
	  || { echo "No CPU wheel of torch $(TORCH_VERSION): $(TORCH_CPU_INDEX) is unreachable and pip finds none locally." \
	            "Install a CPU torch first, or set TORCH_CPU_INDEX to a mirror." >&2; exit 1; }
	$(1) -m pip install -q "torch==$(TORCH_VERSION)"
	$(1) -W ignore -c "import torch; assert torch.version.cuda is None, torch.__version__; print('CPU torch', torch.__version__)"
endef

$(STAMP): pyproject.toml Makefile
	@echo "Setting up $(VENV) (once; a few minutes, about 2.8 GB on disk): CPU torch $(TORCH_VERSION) (~200 MB download)," \
	      "Triton (~1 GB installed), megatron-core, transformers and a small pretrained model, pandas," \
	      "pytest and the notebook tools. pip runs quietly: nothing prints until it is done."
	@if $(PYTHON) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then \
	  echo "GPU torch found: reusing it"; $(PYTHON) -m venv --system-site-packages $(VENV); \
	else \
	  $(PYTHON) -m venv $(VENV) && $(MAKE) --no-print-directory cpu-torch PY_FOR_TORCH=$(PY); \
	fi
	$(PY) -m pip install -q -e ".[test,real,megatron,notebooks]"
	@touch $(STAMP)
	@echo "$(VENV) is ready ($$(du -sh $(VENV) 2>/dev/null | cut -f1))."

$(DOCS_STAMP): $(STAMP)
	@echo "Adding the docs and lint tools to $(VENV) (mkdocs, mkdocs-material, mkdocstrings, ruff; about 150 MB)"
	$(PY) -m pip install -q -e ".[docs,lint]"
	@touch $(DOCS_STAMP)

# internal: the CPU torch into the interpreter PY_FOR_TORCH
.PHONY: cpu-torch
cpu-torch:
	$(call install_cpu_torch,$(PY_FOR_TORCH))

# DEMO_ARGS=--quick: smaller inputs and shorter training (about half the time)
demo: $(STAMP)
	$(PY) -m taco_triton.demo $(DEMO_ARGS)

# The suite runs on TEST_WORKERS processes (pytest-xdist; 2 = the cores of the machines it is
# sized for). Tests that share an expensive module fixture stay on one worker (conftest.py).
TEST_WORKERS ?= 2
XDIST = -n $(TEST_WORKERS)

test: $(STAMP)
	$(PY) -m pytest -q --timeout=900 $(XDIST)

test-thorough: $(STAMP)
	HYPOTHESIS_PROFILE=thorough TACO_TEST_TORCH_BASE=all TACO_TEST_GOLDEN=all $(PY) -m pytest -q --timeout=1800 $(XDIST)

# PyTorch's own distributed test base, all of it, over the compressing process group as the
# default group and as subgroups, next to gloo (make test runs a subset of it)
test-torch-base: $(STAMP)
	TACO_TEST_TORCH_BASE=all $(PY) -m pytest -q --timeout=1800 tests/test_torch_base.py

# the randomized collectives soak, long: 2000 collectives on 3 gloo ranks (CI runs 100)
soak: $(STAMP)
	SOAK_OPS=$${SOAK_OPS:-2000} $(PY) -m pytest -q --timeout=7200 tests/test_collectives.py -k soak

notebooks: $(STAMP)
	$(PY) notebooks/run_all.py

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

docs-serve: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs serve

lint: $(DOCS_STAMP)
	$(PY) -m ruff check .

bench: $(STAMP)
	$(PY) bench/kernel_speed.py

wheel:
	rm -rf $(DIST) build && $(PYTHON) -m pip wheel -q --no-deps -w $(DIST) . && rm -rf build

# A fresh venv with only the CPU torch and the built wheel (and its declared dependencies); it runs
# from another directory, so nothing is imported from the source tree.
wheel-check: wheel
	rm -rf $(WHEEL_VENV) && $(PYTHON) -m venv $(WHEEL_VENV)
	$(call install_cpu_torch,$(WHEEL_VENV)/bin/python)
	$(WHEEL_VENV)/bin/python -m pip install -q $(DIST)/taco_triton-*.whl
	cd $(WHEEL_VENV) && bin/python -c "import torch, taco_triton as taco; from taco_triton import bounds; \
	  assert '/site-packages/' in taco.__file__, taco.__file__; \
	  x = torch.randn(64, 384, dtype=torch.bfloat16); c = taco.compress(x); y = taco.decompress(c); \
	  err = (y.double() - x.double()).norm(); assert err <= bounds.l2_error_bound(x, c, x.dtype), err; \
	  print('taco_triton', taco.__version__, 'from', taco.__file__, ': compress/decompress within its L2 bound')"
	cd $(WHEEL_VENV) && bin/python -m autotune.sweep --help > /dev/null && echo "python -m autotune.sweep --help: ok"
	rm -rf $(WHEEL_VENV)

clean:
	rm -rf $(VENV) $(DIST) site .pytest_cache .hypothesis
