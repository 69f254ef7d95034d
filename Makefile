# The two commands: `make demo` runs the main job, `make test` runs the tests. Both set up .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
export OMP_NUM_THREADS ?= 1
# Every node, coordinator and helper is a fresh interpreter: let them keep our modules' bytecode (~0.3 s each).
unexport PYTHONDONTWRITEBYTECODE

.PHONY: setup demo rl-demo test test-unit bench clean

$(VENV)/.installed: pyproject.toml launch/setup_env.sh
	bash launch/setup_env.sh $(VENV)
	touch $@

setup: $(VENV)/.installed

demo: setup
	rm -rf runs/demo
	$(PY) launch/local.py --nodes 2 --config configs/cpu-demo.toml --run-dir runs/demo

# RL post-training: coordinator, orchestrator, trainer and 2 verified inference workers (launch/rl_demo.py).
rl-demo: setup
	$(PY) launch/rl_demo.py --run-dir runs/rl-demo

# Two workers, a test file each at a time: most tests wait on processes and sockets more than they
# compute (20.9 min on one, 13.8 on two, 2 cores). Tests marked `alone` run with nothing beside them.
test: setup
	$(PY) -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --durations=25 tests

# The unit part alone (tests/unit, under 2 minutes): a developer's loop between full runs.
test-unit: setup
	$(PY) -m pytest -q -p no:cacheprovider -m "not e2e and not slow" tests

clean:
	rm -rf runs .pytest_cache
