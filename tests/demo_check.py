"""The demo's check: merged answers for every key of every view of both pipelines against an
independent reference (the topics read back with confluent-kafka's own Avro deserializer, judged by
hand-written rules and aggregated with pandas). Exits 1 on any difference.

    python -m tests.demo_check
"""

from __future__ import annotations

import sys

from lambdalake.pipeline import configured_pipeline, list_pipelines
from lambdalake.serving import ServingClient
from lambdalake.settings import get_settings
from tests.reference import merged_differences, topic_events


def main() -> int:
    settings = get_settings()
    pipelines = {n: configured_pipeline(n, settings) for n in list_pipelines(settings.pipelines_dir)}
    client = ServingClient(settings=settings, meta_ttl_s=0)
    events = {n: len(topic_events(settings, p)[0]) for n, p in pipelines.items()}
    problems = merged_differences(settings, client, pipelines)
    if problems:
        print("merged answers differ from the reference:")
        for problem in problems[:20]:
            print(f"  {problem}")
        return 1
    counted = ", ".join(f"{n}: {c:,} valid events" for n, c in events.items())
    print(f"✔ every merged answer of {', '.join(pipelines)} equals the independent reference ({counted})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
