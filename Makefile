# The two commands of the quick start. Both install what they need the first time (deploy/setup.sh).
CONFIG ?= configs/tiny_cpu.toml
ARGS ?=
# the run-directory rule's options: RUN=--new-run, or RUN="--resume auto" (default: resume or a new directory, said)
RUN ?=

.PHONY: setup test-deps train cluster test lint docs docs-gen
setup:
	@bash deploy/setup.sh

# Debian's prometheus server, for the end-to-end scrape test, OpenSSH's server, for the --hostfile test (installed when
# this user may apt-get), and bubblewrap, for the tool sandbox's attack tests: as root (CI) they must run, so a failed
# install stops here; as another user they skip (the sandbox needs root).
test-deps: setup
	@bash .ci/install_prometheus.sh || echo "[test] prometheus not installed: the scrape test will be skipped" >&2
	@bash .ci/install_sshd.sh || echo "[test] sshd not installed: the --hostfile (ssh) test will be skipped" >&2
	@bash .ci/install_bubblewrap.sh || { [ "$$(id -u)" -ne 0 ] && echo "[test] bubblewrap not installed: the tool sandbox tests will be skipped" >&2; }

train: setup
	.venv/bin/async-vapo train --config $(CONFIG) $(RUN) $(ARGS)

# PROMETHEUS=1 also runs a Prometheus server scraping the services (http://127.0.0.1:9090, the alert rules of
# deploy/prometheus/; .ci/install_prometheus.sh installs one); ARGS: start_cluster.sh options and overrides.
PROMETHEUS ?=
cluster: setup
	bash deploy/start_cluster.sh --config $(CONFIG) --wait $(if $(PROMETHEUS),--prometheus,) $(RUN) $(ARGS)

# Two pytest workers: the tests that start engines or clusters (or use the session's engines) run on one of them, one
# after another (tests/conftest.py); the rest share the other's time. PYTEST_WORKERS=0 runs everything in one process.
PYTEST_WORKERS ?= 2
test: test-deps
	.venv/bin/ruff check .
	.venv/bin/lint-imports --no-cache
	.venv/bin/python -m pytest -q --durations=25 $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist loadgroup) $(ARGS)
	NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet

# The documentation site (mkdocs.yml, docs/): served with live reload at http://127.0.0.1:8000.
docs: setup
	.venv/bin/mkdocs serve

# Rewrites the reference pages generated from the code (config schema, metric catalogue, CLI parser).
docs-gen: setup
	.venv/bin/python docs/generate.py

lint: setup
	.venv/bin/ruff check .
	.venv/bin/lint-imports --no-cache
