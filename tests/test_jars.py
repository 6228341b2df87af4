"""The JAR cache (lambdalake/jars.py): a bundle's folder names its version and its profile, so a pom
whose dependencies or exclusions change is fetched anew (measured before: keyed by bundle and version
alone, a changed exclusion kept the old JARs for ever)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lambdalake import jars


@pytest.fixture
def pom(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    copy = tmp_path / "pom.xml"
    copy.write_text(jars.POM.read_text())
    monkeypatch.setattr(jars, "POM", copy)
    jars.versions.cache_clear()
    jars.profile_digests.cache_clear()
    yield copy
    jars.versions.cache_clear()
    jars.profile_digests.cache_clear()


def _folders(cache: Path) -> dict[str, Path]:
    jars.versions.cache_clear()
    jars.profile_digests.cache_clear()
    return {b: jars.lib_dir(cache, b) for b in ("kafka", "cassandra", "spark", "delta")}


def test_a_changed_exclusion_names_a_new_folder_for_its_bundle_alone(pom: Path, tmp_path: Path) -> None:
    before = _folders(tmp_path)
    text = pom.read_text()
    assert "<exclusions>" in text
    pom.write_text(text.replace("<exclusions>", "<exclusions><exclusion><groupId>x.y</groupId>"
                                "<artifactId>z</artifactId></exclusion>", 1))  # fmt: skip
    after = _folders(tmp_path)
    changed = {b for b in before if before[b] != after[b]}
    assert len(changed) == 1, changed
    assert all(after[b].name.startswith(f"{b}-{jars.version(b)}-") for b in after)


def test_a_property_a_profile_uses_names_a_new_folder(pom: Path, tmp_path: Path) -> None:
    before = _folders(tmp_path)
    pom.write_text(pom.read_text().replace("<log4j.version>", "<log4j.version>9", 1))
    after = _folders(tmp_path)
    assert before["kafka"] != after["kafka"], "kafka's profile uses log4j.version"
    assert before["cassandra"] == after["cassandra"]


def test_the_same_pom_names_the_same_folder(pom: Path, tmp_path: Path) -> None:
    assert _folders(tmp_path) == _folders(tmp_path)
    pom.write_text(pom.read_text().replace("<profiles>", "<!-- a comment --><profiles>", 1))
    assert _folders(tmp_path) == _folders(tmp_path)


def test_two_processes_fetching_a_bundle_at_once_run_maven_once(tmp_path: Path) -> None:
    """`make setup` builds the CDS archive, whose session fetches the spark bundle, beside `lambdalake
    install`: the second fetcher waits for the first and finds the bundle cached (unlocked, both wrote
    the same `.partial` folder and one removed the other's files). Maven here is a stand-in that
    counts its runs and takes a second."""
    import os
    import subprocess
    import sys
    import textwrap

    bin_dir, runs = tmp_path / "bin", tmp_path / "runs"
    bin_dir.mkdir()
    mvn = bin_dir / "mvn"
    mvn.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import pathlib, sys, time
        with open({str(runs)!r}, "a") as f:
            f.write("run\\n")
        time.sleep(1)
        out = next(a.split("=", 1)[1] for a in sys.argv if a.startswith("-DoutputDirectory="))
        pathlib.Path(out).mkdir(parents=True, exist_ok=True)
        (pathlib.Path(out) / "delta.jar").write_bytes(b"jar")
    """))  # fmt: skip
    mvn.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    code = (
        "from pathlib import Path; from lambdalake import jars; "
        f"print(jars.fetch(Path({str(tmp_path)!r}), 'delta'))"
    )
    fetchers = [
        subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE) for _ in range(2)
    ]
    folders = {p.communicate(timeout=60)[0].decode().strip() for p in fetchers}
    assert [p.returncode for p in fetchers] == [0, 0]
    assert runs.read_text().splitlines() == ["run"]
    (folder,) = folders
    assert Path(folder) == jars.lib_dir(tmp_path, "delta") and jars.cached(tmp_path, "delta")
    assert [p.name for p in Path(folder).glob("*.jar")] == ["delta.jar"]
