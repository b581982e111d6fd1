# Every stage: make <stage> CONFIG=configs/x.yaml ARGS="key.sub=value ..." [NPROC=n]
VENV   ?= .venv
PY      = $(VENV)/bin/python
CONFIG ?= configs/smollm2.yaml
ARGS   ?=
NPROC  ?= 1
# Multi-process runs use torchrun (on CPU, `accelerate launch --cpu` runs a single process).
LAUNCH  = $(if $(filter-out 1,$(NPROC)),$(VENV)/bin/torchrun --standalone --nproc_per_node $(NPROC) -m,$(PY) -m)

.PHONY: setup test test-fast demo generate-data distill eval-speedup clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml scripts/setup.sh
	bash scripts/setup.sh $(VENV)
	touch $@

# pytest exit code 5 means "no tests collected": that is a failure here, never a pass.
test: setup
	$(PY) -m pytest -q -x tests $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "error: pytest collected no tests"; exit 1; fi; exit $$rc

test-fast: setup
	$(MAKE) test PYTEST_ARGS="-m 'not slow'"

generate-data: setup
	$(LAUNCH) distill.generate --config $(CONFIG) $(ARGS)

distill: setup
	$(LAUNCH) distill.train --config $(CONFIG) $(ARGS)

eval-speedup: setup
	$(PY) -m decode.bench --config $(CONFIG) $(ARGS)

demo: setup
	$(MAKE) generate-data CONFIG=configs/smollm2.yaml ARGS="$(ARGS)"
	$(MAKE) distill CONFIG=configs/smollm2.yaml ARGS="$(ARGS)"
	$(MAKE) eval-speedup CONFIG=configs/smollm2.yaml ARGS="$(ARGS)"

clean:
	rm -rf data/tiny runs/tiny
