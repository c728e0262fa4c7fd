# unicon: `make demo` and `make test` are all a newcomer needs (see README).
# The virtual environment is (re)built when the pins (constraints.txt) or pyproject.toml change.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
VPY    := $(VENV)/bin/python
# installed: the package (what make demo and make pretrained need); then the test and DeepSpeed extras (make test)
STAMP  := $(VENV)/.unicon-installed
DEV_STAMP := $(VENV)/.unicon-dev-installed
TORCHSORT_VERSION := $(shell grep -i '^torchsort==' constraints.txt | cut -d= -f3)
export HF_HUB_OFFLINE ?= 1
export TRANSFORMERS_OFFLINE ?= 1
export PIP_DISABLE_PIP_VERSION_CHECK := 1
comma := ,

.PHONY: setup test demo pretrained clean-env

# $(call timed,step,command): run command, then print the step's wall time (set-up says where its time goes)
timed = t=$$(date +%s); $(2) && echo "setup: $(1): $$(( $$(date +%s) - t )) s"

# The whole environment of a developer: the package, the test and DeepSpeed extras.
setup: $(DEV_STAMP)

$(STAMP): constraints.txt pyproject.toml scripts/install_torchsort.sh scripts/wheel_cache.py
	@$(call timed,virtual environment $(VENV),test -x $(VPY) || $(PYTHON) -m venv $(VENV))
	@$(call timed,torch and torchvision,$(VPY) -m pip install -q -c constraints.txt torch torchvision)
	@$(call timed,torchsort (compiled once per machine),PYTHON=$(VPY) bash scripts/install_torchsort.sh $(TORCHSORT_VERSION))
	@$(call timed,unicon and its dependencies,$(VPY) -m pip install -q -c constraints.txt -e .)
	@touch $@

$(DEV_STAMP): $(STAMP)
	@$(call timed,the test and DeepSpeed extras,$(VPY) -m pip install -q -c constraints.txt -e '.[dev$(comma)deepspeed]')
	@touch $@

# DeepSpeed's CPU Adam and shared-memory ops (ZeRO offload and ZeRO on the CPU), prebuilt into a
# DeepSpeed wheel that is compiled once per machine and kept outside the clone (scripts/wheel_cache.py,
# as torchsort's). Only `make test` needs them up front; a run that uses them without this builds
# them on first use.
DS_STAMP := $(VENV)/.unicon-deepspeed-ops
$(DS_STAMP): $(DEV_STAMP) scripts/build_deepspeed_ops.py scripts/wheel_cache.py
	@$(call timed,DeepSpeed with its CPU ops (compiled once per machine),PATH=$(abspath $(VENV))/bin:$$PATH $(VPY) scripts/build_deepspeed_ops.py)
	@touch $@

# One pytest-xdist worker per core; tests sharing an expensive fixture stay together (tests/conftest.py).
# The suite fails if it wrote into the checkout, and prints its slowest tests and the disk it used.
TEST_WORKERS ?= auto
test: $(DEV_STAMP) $(DS_STAMP)
	PATH=$(abspath $(VENV))/bin:$$PATH WANDB_MODE=offline $(VPY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --durations=15 $(PYTEST_ARGS)

# The demo: build ShapesWorld (the README's tour evaluates there) and its caption-gap variant (seconds
# each), then the paper's Table 2 rows K and M on the caption-gap world from its shipped base model
# (checkpoints/shapes_capgap_base), the same data, seed and steps: K cross-entropy only, with
# epoch-end CocoCon; M consistency training, with epoch-end CocoCon / drift / UReason. Each stage
# prints one line with its wall time, each run its headline table (C_1 and rho per task, first and
# last epoch end) above the paths of what it wrote; the demo ends with M against K at the last epoch
# end (`unicon report ... --baseline`, also at the top of M's report.html).
DEMO_BASE_MODEL := checkpoints/shapes_capgap_base
demo: $(STAMP)
	@t0=$$(date +%s); { test -f data/shapes/world.json || $(VENV)/bin/unicon build-data shapes --out data/shapes --workers 2; } && \
	  { test -f data/shapes_capgap/world.json || $(VENV)/bin/unicon build-data shapes --out data/shapes_capgap \
	    --caption-gap purple --caption-gap-keep 0 --workers 2; } && \
	  echo "demo: worlds ready ($$(( $$(date +%s) - t0 )) s)"
	@test -f $(DEMO_BASE_MODEL)/model.safetensors || { echo "demo: $(DEMO_BASE_MODEL) is missing: make pretrained BASE=shapes_capgap_base rebuilds it (checkpoints/README.md)"; exit 2; }
	@t0=$$(date +%s); echo "$(VENV)/bin/unicon train experiment=shapes_demo_control overwrite=true $(ARGS)"; \
	  $(VENV)/bin/unicon train experiment=shapes_demo_control overwrite=true $(ARGS) && \
	  echo "demo: row K, cross-entropy only, with epoch-end CocoCon ($$(( $$(date +%s) - t0 )) s)"
	@t0=$$(date +%s); echo "$(VENV)/bin/unicon train experiment=shapes_demo overwrite=true $(ARGS)"; \
	  $(VENV)/bin/unicon train experiment=shapes_demo overwrite=true $(ARGS) && \
	  echo "demo: row M, consistency training with epoch-end evaluation ($$(( $$(date +%s) - t0 )) s)"
	@$(VENV)/bin/unicon report checkpoints/shapes_demo --baseline checkpoints/shapes_demo_control --brief

# A shipped base model from scratch: BASE=shapes_base (the default; about 80 minutes on 2 CPU cores) or
# BASE=shapes_capgap_base (make demo's start, about 10 minutes). Builds the model's world when missing,
# trains experiment=$(BASE) (runs/$(BASE)), then copies its export to checkpoints/$(BASE) with a
# provenance file (the command, the commit, the world's build command and fingerprint, the wall time and
# the evaluation table measured by the project's own commands; scripts/ship_base_model.py).
BASE := shapes_base
pretrained: $(STAMP)
	$(VENV)/bin/python scripts/ship_base_model.py train --experiment $(BASE)
	PATH=$(abspath $(VENV))/bin:$$PATH $(VPY) scripts/ship_base_model.py evaluate --experiment $(BASE)

clean-env:
	rm -rf $(VENV)
