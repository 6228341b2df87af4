"""The embedded object store: s3proxy (Apache 2.0) on its filesystem backend, under the state folder.

A bucket is a folder of ``data/``; s3proxy answers the S3 API over it, with AWS v2/v4 signatures,
and enforces ``If-None-Match: *`` on PUT (delta-rs commits a version only if its log entry is new).
"""

from __future__ import annotations

from pathlib import Path

from lambdalake import jars
from lambdalake.settings import ObjectStoreSettings

#: s3proxy logs every request at DEBUG by default: warnings only.
LOGBACK = """<configuration>
  <appender name="out" class="ch.qos.logback.core.ConsoleAppender">
    <encoder><pattern>%d{ISO8601} %level %logger{24} %msg%n</pattern></encoder>
  </appender>
  <root level="WARN"><appender-ref ref="out"/></root>
</configuration>
"""


def write_config(home: Path, store: ObjectStoreSettings, *, host: str, port: int, bucket: str) -> Path:
    """s3proxy's properties (the key pair from the settings) and its log config; the bucket's folder.
    Returns the properties file (readable by its owner only: it holds the secret key)."""
    (home / "data" / bucket).mkdir(parents=True, exist_ok=True)
    (home / "logback.xml").write_text(LOGBACK)
    conf = home / "s3proxy.conf"
    conf.touch(mode=0o600, exist_ok=True)
    conf.chmod(0o600)
    conf.write_text(
        f"s3proxy.endpoint=http://{host}:{port}\n"
        "s3proxy.authorization=aws-v2-or-v4\n"
        f"s3proxy.identity={store.access_key}\n"
        f"s3proxy.credential={store.secret_key.get_secret_value()}\n"
        "jclouds.provider=filesystem\n"
        f"jclouds.filesystem.basedir={home / 'data'}\n"
    )
    return conf


def java_argv(home: Path, cache_dir: Path) -> list[str]:
    cp = ":".join(str(j) for j in jars.classpath(cache_dir, "s3proxy"))
    return [
        jars.java(), "-Xmx256m", "-XX:+ExitOnOutOfMemoryError", "-Djava.awt.headless=true",
        f"-Dlogback.configurationFile={home / 'logback.xml'}",
        "-cp", cp, "org.gaul.s3proxy.Main", "--properties", str(home / "s3proxy.conf"),
    ]  # fmt: skip
