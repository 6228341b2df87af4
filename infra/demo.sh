#!/usr/bin/env bash
# `make demo`: the main job end to end on the embedded defaults.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH"
N=${DEMO_EVENTS:-20000}

step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

step "Start the embedded broker, schema registry and Cassandra"
lambdalake up
lambdalake status
lambdalake deploy offers --apply
lambdalake deploy telemetry --apply

step "Produce $N offers and $N telemetry readings (skewed keys, duplicates, late and invalid records)"
lambdalake produce offers --generate "$N" --seed 1
lambdalake produce telemetry --generate "$N" --seed 2

step "Count what landed, with kcat (an independent Kafka client)"
for topic in offers offers.dlq telemetry telemetry.dlq; do
  printf '%-15s %8d records\n' "$topic" "$(kcat -b 127.0.0.1:9092 -C -t "$topic" -e -q -f '%o\n' | wc -l)"
done

step "A dead letter names the rule that failed"
kcat -b 127.0.0.1:9092 -C -t offers.dlq -c 1 -e -q -f 'headers: %h\nvalue:   %s\n'

step "Speed layer: archive into the Delta master dataset, fresh views in Cassandra (Spark local[2])"
lambdalake speed run offers --once
lambdalake speed run telemetry --once

step "Speed views as Cassandra holds them"
lambdalake speed show offers offer_latest --limit 5
lambdalake speed show offers merchant_offers_hourly --key merchant-0000 --limit 5
lambdalake speed show telemetry vehicle_minute --key vehicle-00000 --limit 5

echo
echo "Services keep running; stop them with: lambdalake down"
