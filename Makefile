# One command each; every target first makes the virtual environment it needs.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
OUT ?= runs
# The CIFAR-10 images (ImageFolder) the benchmarks train on, as the tests find them (tests/conftest.py)
CIFAR ?= $(or $(VAE_DDP_CIFAR_SUBSET),../shared/data/cifar10-jpg-subset)

.PHONY: setup browser demo lint test test-full results docs docs-serve legacy legacy-test bench bench-docs gallery stress clean

# pip's own network settings (read from the environment, so an older pip that lacks one ignores it): a download
# the registry interrupts is resumed up to 20 times, and the whole install is tried 3 times (pip's cache keeps
# what the earlier tries downloaded)
PIP_NET := PIP_RETRIES=10 PIP_TIMEOUT=60 PIP_RESUME_RETRIES=20 PIP_DISABLE_PIP_VERSION_CHECK=1

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP_NET) $(PY) -m pip install --upgrade pip >/dev/null || echo "setup: pip not upgraded; going on with $$($(PY) -m pip --version)"
	@for try in 1 2 3; do \
	  $(PIP_NET) $(PY) -m pip install -e ".[dev,docs]" && exit 0; \
	  echo "setup: pip install failed (try $$try of 3)"; sleep 10; \
	done; exit 1
	touch $@

setup: $(VENV)/.installed  ## create .venv and install the project with its test and docs extras

# Debian's chromium for the browser test of the site (tests/test_docs.py); never a downloaded
# browser. Installed with apt-get only when it is missing and apt-get exists (root or sudo -n);
# otherwise the browser test is skipped and says why.
CHROMIUM ?= /usr/bin/chromium

browser:  ## Debian's chromium for the browser test (apt-get install chromium, only if missing)
	@if [ -x "$(CHROMIUM)" ]; then \
	  echo "browser: $(CHROMIUM)"; \
	elif ! command -v apt-get >/dev/null 2>&1; then \
	  echo "browser: $(CHROMIUM) is missing and there is no apt-get; the browser test will be skipped"; \
	else \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO="sudo -n"; fi; \
	  { $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
	    $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium; } \
	  || echo "browser: could not install chromium with apt-get; the browser test will be skipped"; \
	fi

demo: setup  ## the main job on the bundled digits: single, ddp (2 gloo processes) and dp
	$(VENV)/bin/vae-ddp compare --out $(OUT)/demo

# ruff (pyflakes and pycodestyle, configured in pyproject.toml) on every Python folder, before the tests
LINT := $(VENV)/bin/ruff check src tools examples tests benchmarks

lint: setup  ## ruff check (pyflakes, pycodestyle; lines up to 120 characters) on src, tools, examples, tests, benchmarks
	$(LINT)

test: setup browser  ## ruff check, then the test suite (reduced studies; CPU, gloo), the docs build and the browser test
	$(LINT)
	$(PY) -m pytest

test-full: setup browser  ## ruff check, then the full-size studies too (tens of minutes on 2 cores)
	$(LINT)
	VAE_DDP_FULL=1 $(PY) -m pytest

bench: setup  ## benchmarks (medians and ratios): step time per fix, CPU sync BatchNorm, DDPAudit overhead, audit time
	$(PY) benchmarks/step_time.py --data-dir $(CIFAR)
	$(PY) benchmarks/sync_batchnorm.py
	$(PY) benchmarks/audit_overhead.py
	$(PY) benchmarks/audit_time.py

stress: setup  ## 30 runs of each DDP case with DataLoader workers (hangs, failures, exit noise), 20 GlobalSyncBatchNorm trainings with forked and with forkserver workers (hangs, with every process's stacks), then the fault injection: kills during writes, two runs in one folder, a full disk, a killed rank, a changed image (tens of minutes)
	$(PY) benchmarks/stress_workers.py --iterations 30 --out $(OUT)/stress
	$(PY) benchmarks/bn_hang.py --out $(OUT)/bn-hang
	$(PY) benchmarks/fault_injection.py --tries 30 --out $(OUT)/fault-injection

bench-docs: setup  ## the timings and audit calibration the site shows, rewritten into docs/results/ (idle machine; then commit)
	$(PY) benchmarks/step_time.py --models small --data-dir $(CIFAR) --out docs/results/step-time
	$(PY) benchmarks/audit_overhead.py --out docs/results/audit-overhead
	$(PY) benchmarks/audit_false_alarms.py --out docs/results/audit-false-alarms

gallery: setup  ## vae-ddp audit on the real architectures of examples/gallery.py, rewritten into docs/results/audit-gallery (idle machine, many minutes; then commit)
	$(PY) -m pip install -e ".[gallery]"
	$(PY) examples/audit_gallery.py --out docs/results/audit-gallery

results: setup  ## run every example and study of docs/examples.yml into docs/generated/ (cached by their inputs; VAE_DDP_DOCS_JOBS=2: two at once)
	$(PY) tools/results.py

docs: results  ## build the site strictly into site/ from docs/ and the results
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

docs-serve: results  ## serve the site with live reload on http://127.0.0.1:8000 (rerun `make results` after a change)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve

# Legacy environment: Lightning 1.9.5 + lightning-bolts 0.7.0, separate from $(VENV).
LEGACY_VENV ?= .venv-legacy
LPY := $(LEGACY_VENV)/bin/python

$(LEGACY_VENV)/.installed: examples/legacy/requirements.txt
	$(PYTHON) -m venv $(LEGACY_VENV)
	$(LPY) -m pip install -r examples/legacy/requirements.txt
	$(LPY) -m pip install --no-deps -e .
	touch $@

legacy: $(LEGACY_VENV)/.installed  ## .venv-legacy: Lightning 1.9.5 + lightning-bolts 0.7.0 (+ this package, no deps)

legacy-test: legacy  ## parity of bolts' VAE and the port, the report's script and its change, the 1.9.5 factor check
	$(LPY) -m pytest -p no:cacheprovider tests_legacy > examples/legacy/results/legacy-test.txt 2>&1; \
	  rc=$$?; cat examples/legacy/results/legacy-test.txt; exit $$rc

clean:
	rm -rf $(OUT) site docs/generated
