# rmqfast: the two newcomer commands are `make demo` and `make test` (see README).
# Both install what they need first: Python packages (pip), the compiled extension, and the
# RocketMQ jars from Maven Central (built by the test harness on first use).

# Everything goes into a virtualenv inside the checkout, so a clone never disturbs (or
# depends on) what else is installed on the machine.
BASE_PYTHON ?= python3
VENV ?= .venv
PYTHON := $(VENV)/bin/python
PIP := $(PYTHON) -m pip

.PHONY: system-deps test-deps install demo test test-unit test-pure test-integration lint docs clean bench bench-short bench-real bench-clouds bench-idle bench-hostile

$(PYTHON):
	$(BASE_PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

# What `make demo` and `make test` both need, from Debian's packages when missing (apt-get: root or
# sudo): Java 17 and Maven run the real RocketMQ and its Java clients; a C compiler and the Python
# headers build the Cython extension; libnghttp2's headers the gRPC front's HTTP/2 server
# ([grpc] server = "h2").
PY_INCLUDE = $(shell $(BASE_PYTHON) -c "import sysconfig; print(sysconfig.get_paths()['include'])")
system-deps:
	@command -v java >/dev/null && command -v mvn >/dev/null || { \
	  echo "installing Java 17 and Maven from Debian's packages"; \
	  apt-get update -q && apt-get install -y -q openjdk-17-jdk-headless maven; }
	@command -v cc >/dev/null && test -e "$(PY_INCLUDE)/Python.h" || { \
	  echo "installing a C compiler and the Python headers from Debian's packages"; \
	  apt-get update -q && apt-get install -y -q build-essential python3-dev; }
	@test -e /usr/include/nghttp2/nghttp2.h || { \
	  echo "installing libnghttp2-dev from Debian's packages"; \
	  apt-get update -q && apt-get install -y -q libnghttp2-dev; }

# Only the tests need these (the demo does not): Chromium renders the Spark report in a headless
# browser in its test; Go builds the rocketmq-client-go driver of the integration tests (godriver/,
# via the Go module proxy).
test-deps:
	@command -v chromium >/dev/null || { \
	  echo "installing Chromium from Debian's packages (the report's browser test)"; \
	  apt-get update -q && apt-get install -y -q chromium; }
	@command -v go >/dev/null || test -x /usr/local/go/bin/go || { \
	  echo "installing Go from Debian's packages (the Go client's integration tests)"; \
	  apt-get update -q && apt-get install -y -q golang-go; }

# The pip install (and the build of the extensions) runs again only when what it reads changed: the
# package metadata, the build script or a compiled source (a warm `make demo` skips it).
STAMP := $(VENV)/.rmqfast-installed
install: system-deps $(STAMP)

$(STAMP): $(PYTHON) pyproject.toml setup.py $(wildcard ext/*) $(wildcard rmqfast/grpcfront/_h2build.py)
	$(PIP) install --quiet -e '.[test]'
	$(PYTHON) -c "import rmqfast.codec as c; assert c.IMPLEMENTATION == 'compiled', 'Cython extension not built'"
	$(PYTHON) -c "import rmqfast.grpcfront._h2" || { echo 'rmqfast.grpcfront._h2 (libnghttp2) not built'; exit 1; }
	touch $@

demo: install
	$(PYTHON) -m rmqfast demo

# Unit tests with the compiled codec (the Spark report tests among them, local and on a
# standalone cluster), the benchmark suite once with --benchmark-disable, then again with the
# pure-Python reference the tests that touch a twin (marker "twin"); at the same time, in a
# second lane, the integration tests against a real RocketMQ name server + broker and real
# clients (tests/run_suite.sh says why and how).
test: install test-deps lint docs
	PYTHON=$(PYTHON) bash tests/run_suite.sh

test-unit: install
	$(PYTHON) -m pytest -q -m "not integration"

test-integration: install
	$(PYTHON) -m pytest -q -m integration

# ruff, then the import layers of rmqfast (the contract in pyproject.toml [tool.importlinter]:
# a module never imports from a layer above its own; docs/architecture.md).
lint:
	$(PYTHON) -m ruff check rmqfast tests bench spark tools
	$(VENV)/bin/lint-imports --no-cache

# The docs site (mkdocs.yml, docs/): --strict fails on a broken link, a missing anchor or a page
# left out of the nav. Built into site/ (ignored by git); `$(VENV)/bin/mkdocs serve` to read it.
# Not --quiet: mkdocs 1.6 then drops the warnings before --strict counts them, and passes.
docs: install
	NO_MKDOCS_2_WARNING=1 $(PYTHON) -m mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) build dist site *.egg-info ext/*.c ext/*.html rmqfast/*.so java/*/target java/target

# The null-broker bench, then 10,000 mostly idle connections through one worker (RSS per
# connection, connects/s rmqfast vs HAProxy); `make bench-real` adds Apache's proxy on a real broker.
bench: install
	$(PYTHON) -m rmqfast.bench
	$(PYTHON) -m rmqfast.bench --idle

bench-idle: install
	$(PYTHON) -m rmqfast.bench --idle

# A steady client while 20,000 idle connections, descriptor exhaustion, slowloris, gRPC
# half-prefaces and an admin flood hit one worker (~3 min; docs/benchmarks.md#hostile-load).
bench-hostile: install
	$(PYTHON) -m rmqfast.bench --hostile

bench-short: install
	$(PYTHON) -m rmqfast.bench --short

bench-real: install
	$(PYTHON) -m rmqfast.bench --real

bench-clouds: install
	$(PYTHON) -m rmqfast.bench --clouds
