"""JVM bundles fetched from Maven Central with Maven itself into the state cache, once.

``lambdalake/maven/pom.xml`` holds one profile a bundle and every version as a property. A bundle lands in
``<cache>/jars/<bundle>-<version>-<digest of its profile>/`` (a folder made complete under a temporary
name, then renamed),
so a later ``make setup`` finds it and asks no registry.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Literal

from lambdalake.errors import LambdalakeError

POM = Path(__file__).resolve().parent / "maven" / "pom.xml"
#: The Real-time writer's Maven module (built from source, not fetched).
WRITER = POM.parent / "writer"
_NS = {"m": "http://maven.apache.org/POM/4.0.0"}

Bundle = Literal["kafka", "cassandra", "spark", "delta", "writer", "s3proxy", "s3a"]
#: Long enough for a first fetch on a slow link (the two bundles are ~110 MB); a registry that hangs
#: past it is reported, not waited on for ever.
FETCH_TIMEOUT_S = 1200.0


@functools.cache
def versions() -> dict[str, str]:
    """The pom's properties: ``{"kafka.version": "4.1.1", ...}``."""
    props = ET.parse(POM).getroot().find("m:properties", _NS)
    assert props is not None, f"{POM} has no <properties>"
    return {child.tag.split("}", 1)[1]: (child.text or "").strip() for child in props}


def version(bundle: Bundle) -> str:
    name = {"writer": "cassandra-driver", "s3a": "hadoop-aws"}.get(bundle, bundle)
    return versions()[f"{name}.version"]


def lib_dir(cache_dir: Path, bundle: Bundle) -> Path:
    """The bundle's folder: named by its version and by a digest of its profile in the pom (with the
    properties it names), so a changed dependency or exclusion is fetched anew, beside the old one.
    The writer's digest is of its module (pom and sources): a changed source is built anew."""
    digest = writer_digest() if bundle == "writer" else profile_digests()[bundle]
    return cache_dir / "jars" / f"{bundle}-{version(bundle)}-{digest}"


@functools.cache
def writer_digest() -> str:
    """12 hex digits of the writer module's files and of the parent pom's properties."""
    h = hashlib.sha256(json.dumps(versions(), sort_keys=True).encode())
    for path in sorted(p for p in WRITER.rglob("*") if p.is_file() and "target" not in p.parts):
        h.update(str(path.relative_to(WRITER)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:12]


@functools.cache
def profile_digests() -> dict[str, str]:
    """Per profile id, 12 hex digits of the profile's XML and the values of the properties it uses."""
    root = ET.parse(POM).getroot()
    out = {}
    for profile in root.iterfind("m:profiles/m:profile", _NS):
        ident = profile.find("m:id", _NS)
        if ident is None or not ident.text:
            continue
        text = ET.canonicalize(ET.tostring(profile, encoding="unicode"), strip_text=True)
        used = sorted(set(re.findall(r"\$\{([^}]+)\}", text)))
        text += "".join(f"\n{name}={versions().get(name, '')}" for name in used)
        out[ident.text.strip()] = hashlib.sha256(text.encode()).hexdigest()[:12]
    return out


def cached(cache_dir: Path, bundle: Bundle) -> bool:
    """Whether the bundle's folder is complete in the cache (a later ``fetch`` asks no registry)."""
    return (lib_dir(cache_dir, bundle) / ".complete").exists()


def classpath(cache_dir: Path, bundle: Bundle) -> list[Path]:
    """The bundle's JARs, fetched first if they are not in the cache."""
    return sorted(fetch(cache_dir, bundle).glob("*.jar"))


def fetch(cache_dir: Path, bundle: Bundle) -> Path:
    """Copy the bundle and its dependencies into the cache (idempotent). Returns its folder.

    Safe for processes that fetch at once (``make setup`` builds the CDS archive, whose Spark session
    needs the spark and delta bundles, beside ``lambdalake install``): one fetches under a lock on
    the bundle, and the others wait for it and find the bundle cached."""
    target = lib_dir(cache_dir, bundle)
    if cached(cache_dir, bundle):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with target.with_name(target.name + ".lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or when the process dies
        if cached(cache_dir, bundle):
            return target
        return _fetch(target, bundle)


def _fetch(target: Path, bundle: Bundle) -> Path:
    if shutil.which("mvn") is None:
        raise LambdalakeError(
            f"Maven is needed to fetch {bundle} {version(bundle)} and is not installed",
            fix="apt-get install -y maven, then `make setup`",
        )
    partial = target.with_name(target.name + ".partial").resolve()
    shutil.rmtree(partial, ignore_errors=True)
    if bundle == "writer":
        # Compiled in a folder of the cache's (never in the checkout), the jar and its runtime
        # dependencies then copied beside each other.
        argv = [
            "mvn", "-B", "-q", "-f", str(WRITER / "pom.xml"), f"-Dbuild.folder={partial}/build", "package",
            "dependency:copy-dependencies", "-DincludeScope=runtime", f"-DoutputDirectory={partial}",
        ]  # fmt: skip
    else:
        argv = [
            "mvn", "-B", "-q", "-f", str(POM), "-P", bundle, "dependency:copy-dependencies",
            "-DincludeScope=runtime", f"-DoutputDirectory={partial}",
        ]  # fmt: skip
    command = " ".join(argv)
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=FETCH_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise LambdalakeError(
            f"fetching {bundle} {version(bundle)} from Maven Central did not finish within "
            f"{FETCH_TIMEOUT_S:.0f}s (`{command}`)",
            fix="the registry did not answer: check the network, then `make setup` again",
        ) from None
    if out.returncode != 0 or not any(partial.glob("*.jar")):
        raise LambdalakeError(
            f"fetching {bundle} {version(bundle)} failed: {_missing(out.stdout + out.stderr)}\n"
            f"  command: {command}",
            fix="check that Maven Central is reachable and the version in lambdalake/maven/pom.xml exists, "
            "then `make setup`",
        )
    if bundle == "writer":
        for jar in (partial / "build").glob("*.jar"):
            jar.rename(partial / jar.name)
        shutil.rmtree(partial / "build")
    (partial / ".complete").write_text(version(bundle))
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)
    return target


def java() -> str:
    """The ``java`` that runs the bundles: ``$JAVA_HOME/bin/java``, else the one on ``PATH``."""
    home = os.environ.get("JAVA_HOME")
    if home and os.access(Path(home) / "bin" / "java", os.X_OK):
        return str(Path(home) / "bin" / "java")
    found = shutil.which("java")
    if found is None:
        raise LambdalakeError(
            "Java is needed to run the embedded Kafka broker and Cassandra, and no `java` was found "
            "(neither $JAVA_HOME/bin/java nor on PATH)",
            fix="apt-get install -y openjdk-17-jre-headless (or set JAVA_HOME), then `lambdalake up`",
        )
    return found


def _missing(output: str) -> str:
    """The artifact Maven could not resolve, or the last lines of what it said."""
    found = re.search(
        r"(?:Could not (?:resolve|find|transfer) artifact|could not be resolved:?)\s*([^\s,]+)", output
    )
    if found:
        return f"artifact {found.group(1)} could not be resolved"
    lines = [line for line in output.splitlines() if line.strip()]
    return "\n    ".join(lines[-6:]) or "Maven exited without saying why"
