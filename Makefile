# lambdalake: every target installs what it needs first, so each works on a fresh machine.
SHELL := /bin/bash
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export PATH := $(CURDIR)/$(BIN):$(PATH)

.PHONY: setup up down status deploy undeploy test test-realtime soak demo lint docs bench clean

# The JARs' fetch and the CDS archive's build need the venv but not each other: they run side by side
# (about 10 s less on a fresh machine than one after the other; docs/benchmarks-log.md, 2026-12-06 sixth).
setup: $(STAMP) .lambdalake/.apt .lambdalake/.pyc
	@$(MAKE) --no-print-directory -j2 .lambdalake/.jars .lambdalake/.spark-cds

$(BIN)/python:
	@command -v $(PY) >/dev/null || { echo "Python 3.11 is needed ($(PY) not found)"; exit 1; }
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# Re-installs only when pyproject.toml changes. pyspark builds a ~450 MB wheel from its sdist once.
# uv installs it all in about 38 s where pip took 66-71 s; with the system's certificates and pip's
# local wheels (PIP_FIND_LINKS) when the machine sets them. pip does it if uv cannot be had or fails.
# Compiled to bytecode at install, as pip does: where PYTHONDONTWRITEBYTECODE is set (these machines),
# Python never writes it, and every process compiled what it imported (a command started in 1.13 s, not 0.61).
$(STAMP): pyproject.toml | $(BIN)/python
	@test -x $(BIN)/uv || $(BIN)/pip install -q uv || true
	$(BIN)/uv pip install --python $(BIN)/python --native-tls --compile-bytecode -q \
		$(if $(PIP_FIND_LINKS),--find-links $(PIP_FIND_LINKS)) -e '.[dev]' \
		|| $(BIN)/pip install -q -e '.[dev]'
	@touch $@

# The project's own modules compiled to bytecode too (an editable install leaves them as sources): again
# when one changes. Without it every command, job and Python worker compiled them on each start here.
PY_SOURCES := $(shell find -L lambdalake -name '*.py' -not -path '*/__pycache__/*')
.lambdalake/.pyc: $(STAMP) $(PY_SOURCES)
	@mkdir -p .lambdalake
	$(BIN)/python -m compileall -q lambdalake
	@touch $@

# kcat: an independent Kafka client the tests count records with; curl: the HTTP contract test's client.
# Java 17 and Maven come with the machine.
.lambdalake/.apt:
	@mkdir -p .lambdalake
	@command -v kcat >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq kcat >/dev/null; }
	@command -v curl >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq curl >/dev/null; }
	@command -v java >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openjdk-17-jre-headless >/dev/null; }
	@command -v mvn >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq maven >/dev/null; }
	@touch $@

# Apache Kafka and Apache Cassandra JARs, and Spark's Kafka connector, fetched from Maven Central
# once into .lambdalake/cache/jars/ (versions in lambdalake/maven/pom.xml; a new version is fetched beside the old one),
# and the latest views' Real-time writer built from lambdalake/maven/writer/ (a changed source is built anew).
.lambdalake/.jars: $(STAMP) .lambdalake/.apt lambdalake/maven/pom.xml $(shell find lambdalake/maven/writer -type f -not -path '*/target/*')
	$(BIN)/lambdalake install
	@touch $@

# The Spark driver's class-data-sharing archive (lambdalake/spark/cds.py): built once, ~30 s; every
# Spark process then starts ~2 s sooner. A failed build is reported and only costs that gain.
.lambdalake/.spark-cds: $(STAMP) .lambdalake/.apt
	$(BIN)/python -m lambdalake.spark.cds
	@touch $@

up: setup
	$(BIN)/lambdalake up $(if $(NODES),--nodes $(NODES))

down:
	$(BIN)/lambdalake down

status: setup
	$(BIN)/lambdalake status

# Topics, schemas, tables, speed jobs, batch scheduler and serving API for every pipelines/*.toml.
deploy: up
	$(BIN)/lambdalake deploy

undeploy: setup
	$(BIN)/lambdalake undeploy

# The suite in three pytest-xdist workers, each with services of its own on ports 1000 apart and whole
# test files, the slowest first (module fixtures stay in one worker). On two cores, one process left
# 36 % of them idle and two workers ~20 % (tests wait for epochs to close and jobs to start); three
# took 0.89x two's time, 4 % idle, at most 19 GB of memory (docs/benchmarks-log.md).
# TEST_WORKERS=1 make test runs it in one process.
TEST_WORKERS ?= 3
PYTEST := $(BIN)/python -m pytest $(if $(filter-out 1,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)
test: setup
	$(PYTEST)

# The whole suite again with the latest views written by their Real-time query (speed.latest =
# realtime), so every latest-view test runs on that path too; `make test` runs the micro-batch path
# and, of the Real-time one, tests/test_realtime.py, tests/test_realtime_property.py and
# tests/test_spark_rules.py (at the default 5 s batches). Here batches last 2 s: a job's catch_up
# waits for the Real-time batch that wrote what it read, and tests that must catch up inside one
# 10-second epoch catch several jobs up.
test-realtime: setup
	LAMBDALAKE_SPEED__LATEST=realtime LAMBDALAKE_SPEED__REALTIME_BATCH_S=2 $(PYTEST)

# The seeded operations schedule, long (make test runs a short one), and views changed ROUNDS times
# on a live pipeline, the engines' property tests with more examples, and the churn soak on three
# nodes for CHURN seconds (make test: 600): STEPS=40 SEED=123 ROUNDS=6 PROPERTY_EXAMPLES=500 CHURN=1800 make soak.
soak: setup
	LAMBDALAKE_SCHEDULE_STEPS=$${STEPS:-40} LAMBDALAKE_SCHEDULE_SEED=$${SEED:-} \
		LAMBDALAKE_VIEW_SOAK_ROUNDS=$${ROUNDS:-6} LAMBDALAKE_INCREMENTAL_EXAMPLES=$${EXAMPLES:-5} \
		LAMBDALAKE_PROPERTY_EXAMPLES=$${PROPERTY_EXAMPLES:-500} \
		$(BIN)/python -m pytest -s tests/test_operations_schedule.py tests/test_view_versions.py \
		tests/test_incremental_batch.py tests/test_filters.py tests/test_latest_rule.py
	$(BIN)/python -m bench.churn --seconds $${CHURN:-1800}

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

# The documentation site (docs/, mkdocs.yml) into site/; `make test` builds it strictly too.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

demo: setup
	bash lambdalake/cli/demo.sh

bench: setup
	$(BIN)/python -m bench.produce
	$(BIN)/python -m bench.produce_file
	$(BIN)/python -m bench.decode
	$(BIN)/python -m bench.rules
	$(BIN)/python -m bench.speed
# A speed micro-batch's master dataset commit as the master dataset grows (Delta logs of 1k-150k files).
	$(BIN)/python -m bench.master_commits
# The same commit before and after a compaction round, on master datasets of 1k-50k real small files.
	$(BIN)/python -m bench.compaction
# The speed layer beside quix-streams (in a virtualenv of its own, made on first use: it pins
# confluent-kafka below the project's).
	$(BIN)/python -m bench.peers
	$(BIN)/python -m bench.batch
	$(BIN)/python -m bench.serving
# distinct and quantiles aggregates against count and sum: batch, speed job, serving.
	$(BIN)/python -m bench.sketches
# One node of each service against three (lambdalake up --nodes 3), the same benchmarks on both.
	$(BIN)/python -m bench.cluster
# Three nodes under churn (kills and restarts of every kind) with 20 HTTP clients: server errors,
# 503s, p99 with and without churn, records acknowledged and counted.
	$(BIN)/python -m bench.churn --seconds 600

clean: down
	rm -rf .lambdalake
