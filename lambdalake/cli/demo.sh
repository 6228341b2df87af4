#!/usr/bin/env bash
# `make demo`: the platform end to end on the embedded defaults, checked against a reference.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PATH="$PWD/.venv/bin:$PATH"
N=${DEMO_EVENTS:-5000}

step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

# The demo's own topics, keyspace, storage and pipeline files (20-second ingest epochs, see
# lambdalake/cli/demo.py), so a rerun starts clean and never mixes with your own pipelines' data.
RUN="demo$(date +%s)"
export LAMBDALAKE_TOPIC_PREFIX="$RUN-"
export LAMBDALAKE_CASSANDRA__KEYSPACE="$RUN"
export LAMBDALAKE_STORAGE_ROOT="$PWD/.lambdalake/demo/$RUN/storage"
export LAMBDALAKE_PIPELINES_DIR="$PWD/.lambdalake/demo/$RUN/pipelines"
python -m lambdalake.cli.demo pipelines "$LAMBDALAKE_PIPELINES_DIR"

step "Start the embedded broker, schema registry and Cassandra"
lambdalake up
lambdalake status --services

step "Deploy both pipelines: topics, schemas, tables, speed jobs, batch scheduler, serving API"
lambdalake deploy

step "First wave: $N offers and $N telemetry readings (skewed keys, duplicates, late and invalid records)"
lambdalake produce offers --generate "$N" --seed 1
lambdalake produce telemetry --generate "$N" --seed 2
python -m lambdalake.cli.demo wait-archived

step "Count what landed, with kcat (an independent Kafka client)"
BROKER=$(lambdalake config | python -c 'import json,sys; print(json.load(sys.stdin)["kafka"]["bootstrap_servers"])')
for topic in offers offers.dlq telemetry telemetry.dlq; do
  printf '%-28s %8d records\n' "$RUN-$topic" "$(kcat -b "$BROKER" -C -t "$RUN-$topic" -e -q -f '%o\n' | wc -l)"
done
echo "A dead letter names the rule that failed:"
kcat -b "$BROKER" -C -t "$RUN-offers.dlq" -c 1 -e -q -f '  headers: %h\n'

step "Batch layer: rebuild the views from the master dataset once the first wave's epoch has closed"
python -m lambdalake.cli.demo wait-epoch-closed
lambdalake batch run offers
lambdalake batch run telemetry

step "Second wave while the speed jobs run: later updates of the same offers, for hours the batch covers"
lambdalake produce offers --generate "$((N / 2))" --seed 3
lambdalake produce telemetry --generate "$((N / 2))" --seed 4
python -m lambdalake.cli.demo wait-archived

step "Merged answers: the batch row (epochs <= horizon) plus speed rows of later epochs"
MERCHANT=$(python -m lambdalake.cli.demo pick-merchant)
# The last two hours (the generator also sends events days late: those windows exist too).
lambdalake query offers merchant_offers_hourly --key "$MERCHANT" --from "$(date -u -d '-2 hours' +%Y-%m-%dT%H:00:00Z)"
lambdalake query offers offer_latest --key offer-000001
lambdalake query telemetry vehicle_latest --key vehicle-00000

step "Check every merged answer of both pipelines against an independent reference"
python -m tests.demo_check

step "Status"
lambdalake status

PORT=$(lambdalake config | python -c 'import json,sys; print(json.load(sys.stdin)["serving"]["port"])')
cat <<TEXT

Query by hand (the demo's settings first: export LAMBDALAKE_TOPIC_PREFIX=$RUN- LAMBDALAKE_CASSANDRA__KEYSPACE=$RUN \\
  LAMBDALAKE_STORAGE_ROOT=$LAMBDALAKE_STORAGE_ROOT LAMBDALAKE_PIPELINES_DIR=$LAMBDALAKE_PIPELINES_DIR):
  CLI:    lambdalake query offers merchant_offers_hourly --key $MERCHANT --format json
  HTTP:   curl http://127.0.0.1:$PORT/v1/pipelines/offers/views/merchant_offers_hourly/keys/$MERCHANT
          (OpenAPI docs: http://127.0.0.1:$PORT/docs, metrics: http://127.0.0.1:$PORT/metrics)
  Python: from lambdalake.serving import ServingClient; from lambdalake.settings import get_settings
          ServingClient(settings=get_settings()).query("offers", "merchant_offers_hourly", "$MERCHANT")
Stop the jobs with: lambdalake undeploy    (and the services with: lambdalake down)
TEXT
