# unicon: `make demo` and `make test` are all a newcomer needs (see README).
# The virtual environment is (re)built when the pins (constraints.txt) or pyproject.toml change.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
VPY    := $(VENV)/bin/python
STAMP  := $(VENV)/.unicon-installed
TORCHSORT_VERSION := $(shell grep -i '^torchsort==' constraints.txt | cut -d= -f3)
export HF_HUB_OFFLINE ?= 1
export TRANSFORMERS_OFFLINE ?= 1
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: setup test demo clean-env lint

setup: $(STAMP)

$(STAMP): constraints.txt pyproject.toml scripts/install_torchsort.sh scripts/build_deepspeed_ops.py
	@test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install -q -c constraints.txt torch torchvision
	PYTHON=$(VPY) bash scripts/install_torchsort.sh $(TORCHSORT_VERSION)
	$(VPY) -m pip install -q -c constraints.txt -e '.[dev,deepspeed]'
	# DeepSpeed's CPU Adam and shared-memory ops, compiled once, with the venv's ninja (as in the venv,
	# its jobs and the tests: another ninja version would make torch rebuild them)
	PATH=$(abspath $(VENV))/bin:$$PATH $(VPY) scripts/build_deepspeed_ops.py
	@touch $@

# One pytest-xdist worker per core; tests sharing an expensive fixture stay together (tests/conftest.py).
# The suite fails if it wrote into the checkout, and prints its slowest tests and the disk it used.
TEST_WORKERS ?= auto
test: $(STAMP)
	PATH=$(abspath $(VENV))/bin:$$PATH WANDB_MODE=offline $(VPY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --durations=15 $(PYTEST_ARGS)

# The demo: build ShapesWorld (seconds), pretrain the tiny OFA once (minutes; reused afterwards),
# then consistency training with epoch-end CocoCon / drift / UReason evaluation.
# Each stage prints one line with its wall time.
demo: $(STAMP)
	@t0=$$(date +%s); test -f data/shapes/world.json || $(VENV)/bin/unicon build-data shapes --out data/shapes && \
	  echo "demo: world ready ($$(( $$(date +%s) - t0 )) s)"
	@t0=$$(date +%s); test -f checkpoints/shapes_pretrain/export/config.json || \
	  $(VENV)/bin/unicon train experiment=shapes_pretrain && echo "demo: pretrained model ready ($$(( $$(date +%s) - t0 )) s)"
	@t0=$$(date +%s); echo "$(VENV)/bin/unicon train experiment=shapes_demo overwrite=true $(ARGS)"; \
	  $(VENV)/bin/unicon train experiment=shapes_demo overwrite=true $(ARGS) && \
	  echo "demo: consistency training with epoch-end evaluation ($$(( $$(date +%s) - t0 )) s)"

clean-env:
	rm -rf $(VENV)
