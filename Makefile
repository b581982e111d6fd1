# Every stage: make <stage> CONFIG=configs/x.yaml ARGS="key.sub=value ..." [NPROC=n]
VENV   ?= .venv
PY      = $(VENV)/bin/python
CONFIG ?= configs/smollm2.yaml
ARGS   ?=
NPROC  ?= 1
# Multi-process runs use torchrun (on CPU, `accelerate launch --cpu` runs a single process).
LAUNCH  = $(if $(filter-out 1,$(NPROC)),$(VENV)/bin/torchrun --standalone --nproc_per_node $(NPROC) -m,$(PY) -m)
# Before a multi-process launch, the config alone is checked once (~2.5 s): one error line instead of every rank's.
CHECK   = $(if $(filter-out 1,$(NPROC)),$(PY) -m common.cli --config $(CONFIG) $(ARGS) &&,)

.PHONY: setup test test-fast demo demo-standalone demo-feature generate-data distill onpolicy features eval-speedup docs clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml scripts/setup.sh
	bash scripts/setup.sh $(VENV)
	touch $@

# pytest exit code 5 means "no tests collected": that is a failure here, never a pass.
# One pytest-xdist worker per core, at most 4; a test file stays on one worker (its fixtures are built once).
test: setup
	$(PY) -m pytest -q -x -n auto --maxprocesses 4 --dist loadfile tests $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "error: pytest collected no tests"; exit 1; fi; exit $$rc

test-fast: setup
	$(MAKE) test PYTEST_ARGS="-m 'not slow'"

generate-data: setup
	$(CHECK) $(LAUNCH) distill.generate --config $(CONFIG) $(ARGS)

distill: setup
	$(CHECK) $(LAUNCH) distill.train --config $(CONFIG) $(ARGS)

# After make distill: rounds in which the draft samples completions, the target scores them, training
# continues on the mixture (onpolicy.* settings; its rounds.json says what each round reached).
onpolicy: setup
	$(PY) -m distill.onpolicy --config $(CONFIG) $(ARGS)

# A feature draft's stored teacher (distill.teacher=stored): the target's hidden states of the layers it reads.
features: setup
	$(PY) -m distill.features --config $(CONFIG) $(ARGS)

eval-speedup: setup
	$(PY) -m decode.bench --config $(CONFIG) $(ARGS)

# make demo: the recipe of configs/demo-recipes.yaml that was timed within this CPU class's budget (25 minutes
# where the CPU computes bf16 natively, 45 on an AVX2 one), and it says which and why before it starts.
# DEMO_RECIPE=feature|standalone chooses by hand; DEMO_MINUTES=m sets another budget.
DEMO_RECIPE  ?= auto
DEMO_MINUTES ?=
demo: setup
	target=$$($(PY) -m common.demo_recipe --recipe $(DEMO_RECIPE) $(if $(DEMO_MINUTES),--minutes $(DEMO_MINUTES))) \
		&& $(MAKE) $$target ARGS="$(ARGS)"

# The standalone draft (configs/smollm2.yaml): generate-data, distill, eval-speedup.
demo-standalone: setup
	$(MAKE) generate-data CONFIG=configs/smollm2.yaml ARGS="$(ARGS)"
	$(MAKE) distill CONFIG=configs/smollm2.yaml ARGS="$(ARGS)"
	$(MAKE) eval-speedup CONFIG=configs/smollm2.yaml ARGS="$(ARGS)"

# The feature draft (configs/smollm2-feature.yaml) on the demo's data: generate-data skips what the demo
# made (or, run first, keeps the stored teacher's hidden states as it samples), then the states the data
# lacks, 600 training steps and its eval-speedup (~32 minutes after the demo's data on 2 CPU cores).
FEATURE_CONFIG ?= configs/smollm2-feature.yaml
demo-feature: setup
	$(MAKE) generate-data CONFIG=$(FEATURE_CONFIG) ARGS="$(ARGS)"
	$(MAKE) features CONFIG=$(FEATURE_CONFIG) ARGS="$(ARGS)"
	$(MAKE) distill CONFIG=$(FEATURE_CONFIG) ARGS="$(ARGS)"
	$(MAKE) eval-speedup CONFIG=$(FEATURE_CONFIG) ARGS="$(ARGS)"

# docs/configuration.md, generated from the config classes (tests/test_docs.py checks it is current).
docs: setup
	$(PY) -m common.config_reference > docs/configuration.md.tmp && mv docs/configuration.md.tmp docs/configuration.md

clean:
	rm -rf data/tiny runs/tiny

# The optional vLLM environment behind generate.engine=vllm (scripts/setup_vllm.sh); not part of `setup`.
VLLM_VENV ?= .venv-vllm

.PHONY: setup-vllm test-vllm

setup-vllm: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: scripts/setup_vllm.sh
	bash scripts/setup_vllm.sh $(VLLM_VENV)
	touch $@

# The end-to-end vLLM tests (marker `vllm`). Where the vLLM environment is missing they fail,
# never skip: SPEC_DISTILL_REQUIRE_VLLM turns the main suite's skip into a failure.
test-vllm: setup
	@test -f $(VLLM_VENV)/.installed || { echo "error: no vLLM environment in $(VLLM_VENV): run make setup-vllm"; exit 1; }
	SPEC_DISTILL_VLLM_PYTHON=$(VLLM_VENV)/bin/python SPEC_DISTILL_REQUIRE_VLLM=1 \
	$(PY) -m pytest -q -m vllm tests/test_vllm_engine.py; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "error: pytest collected no vLLM tests"; exit 1; fi; exit $$rc

# Serving engines (decode/engines/): the draft as files engines load, measured inside HF, vLLM and
# llama.cpp. vLLM and llama.cpp are optional and set up by their own targets; eval-engines says which
# one is missing.
.PHONY: export eval-engines setup-llamacpp

export: setup
	$(PY) -m distill.export.engines --config $(CONFIG) $(ARGS)

eval-engines: export
	$(PY) -m decode.engines --config $(CONFIG) $(ARGS)

# llama.cpp's tools built from the llama-cpp-python sdist into .llamacpp/bin (~11 min on 2 cores; skipped when built).
setup-llamacpp: setup
	PYTHON=$(PY) bash scripts/setup_llamacpp.sh .llamacpp
