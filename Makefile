# distmem: two commands on a fresh machine.
#   make demo   the main job: horovodrun -np 4 on examples/train.py (CPU when no GPU), report in runs/demo/
#   make test   the whole test suite (unit, mpirun -np 1/2/4, horovodrun -np 4 Gloo and MPI, TF 2.21 pass)
#   make env    build (or reuse) the environment; its bin/ folder is the last line printed
# Each installs what it needs (scripts/env.sh: a venv outside the clone, keyed by requirements/).
# The environment's distmem, horovodrun and python on PATH:  export PATH=$(make -s env | tail -n 1):$PATH
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
# Open MPI refuses root without these (CI and containers run as root); harmless otherwise.
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
export PYTHONUNBUFFERED := 1
NP ?= 4
DEMO_STEPS ?= 30
# Declared GPUs for the demo's plan on a machine without any; ignored where NVML finds real GPUs.
DEMO_FLEET ?= 2x16GiB

.PHONY: env env-latest demo test test-main test-latest native clean help

help:
	@awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' Makefile

env:
	@scripts/env.sh main

env-latest:
	@scripts/env.sh latest

native:
	@bash scripts/build_native.sh

demo:
	@bin=$$(scripts/env.sh main | tail -n 1); \
	bash scripts/build_native.sh >/dev/null 2>&1 || echo "[make demo] native cap not built (optional)"; \
	rm -f runs/demo/report.json; \
	DISTMEM_FLEET='$(DEMO_FLEET)' $$bin/python -m distmem plan --ranks $(NP) >/dev/null || exit 1; \
	echo "[make demo] horovodrun -np $(NP) -H localhost:$(NP) python examples/train.py"; \
	echo "[make demo] without a GPU the plan is made against DISTMEM_FLEET=$(DEMO_FLEET) (dry run: planned, not applied)"; \
	DISTMEM_FLEET='$(DEMO_FLEET)' TF_CPP_MIN_LOG_LEVEL=$${TF_CPP_MIN_LOG_LEVEL:-2} timeout --foreground 900 \
	  $$bin/horovodrun -np $(NP) -H localhost:$(NP) $$bin/python examples/train.py \
	  --steps $(DEMO_STEPS) --report runs/demo/report.json --plot runs/demo/report.png; \
	test -s runs/demo/report.json && echo "[make demo] report: runs/demo/report.json"

test: test-main test-latest

test-main:
	@bin=$$(scripts/env.sh main | tail -n 1); \
	bash scripts/build_native.sh >/dev/null 2>&1 || echo "[make test] native cap build failed; its tests will say why"; \
	echo "[make test] main environment: TensorFlow 2.15.1 + Horovod 0.28.1 + Open MPI"; \
	bash scripts/cluster_deps.sh || echo "[make test] cluster packages not installed; tests/cluster will say why"; \
	DISTMEM_ENV_BIN=$$bin $$bin/python -m pytest tests -q -ra -p no:cacheprovider

test-latest:
	@bin=$$(scripts/env.sh latest | tail -n 1); \
	echo "[make test] latest environment: TensorFlow 2.21 (Keras 3), no Horovod"; \
	DISTMEM_ENV_BIN=$$bin $$bin/python -m pytest tests/unit tests/tfdist -q -ra -p no:cacheprovider -m "not horovod"

clean:
	rm -rf build runs distmem/_native/*.so
