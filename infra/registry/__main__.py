"""``python -m lambdalake.infra.registry``: run the embedded schema registry in the foreground."""

from __future__ import annotations

import argparse
import logging
import sys

from lambdalake.infra.registry.server import make_server
from lambdalake.infra.registry.store import KafkaBackedStore
from lambdalake.settings import get_settings


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8081)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    settings = get_settings()
    store = KafkaBackedStore(
        kafka_config=settings.kafka.client_config(),
        topic=settings.registry.schemas_topic,
        default_level=settings.registry.default_compatibility,
    )
    users, writers, tls = None, None, None
    if settings.secure:  # `up --secure`: HTTPS with the embedded CA's certificate, and a login
        from lambdalake import secure
        from lambdalake.infra.tls import ensure

        files = ensure(settings.state_dir)
        tls = (str(files.cert), str(files.key))
        logins = secure.principals(settings.state_dir)
        users = {login["username"]: login["password"] for login in logins.values()}
        writers = frozenset({logins["admin"]["username"]})  # the other roles only read schemas
    server = make_server(store, args.host, args.port, users=users, writers=writers, tls=tls)
    logging.info(
        "schema registry on %s://%s:%d (state in topic %s, %d schemas read)",
        "https" if tls else "http",
        args.host,
        args.port,
        store.topic,
        len(store.state.schemas),
    )
    try:
        server.run()  # uvicorn stops on SIGTERM/SIGINT
    finally:
        store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
