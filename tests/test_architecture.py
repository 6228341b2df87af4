"""The import graph and the wheel: one namespace, nothing importing upwards (pyproject's import-linter
contracts), and an installed lambdalake that holds every module of the checkout and nothing else."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from lambdalake.settings import PROJECT_ROOT

LAYERS = ("speed", "batch", "serving", "infra")


def _lint_imports(cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(Path(sys.executable).with_name("lint-imports")), "--no-cache"],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_import_contracts_hold() -> None:
    result = _lint_imports(PROJECT_ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout


def test_an_import_upwards_breaks_the_contracts(tmp_path: Path) -> None:
    """The same contracts on a copy of the package where the core imports the CLI: lint-imports fails
    and names the import, so the test above is one that can fail."""
    copy = tmp_path / "repo"
    copy.mkdir()
    (copy / "pyproject.toml").write_text((PROJECT_ROOT / "pyproject.toml").read_text())
    subprocess.run(
        ["cp", "-rL", str(PROJECT_ROOT / "lambdalake"), str(copy / "lambdalake")], check=True, timeout=60
    )
    for cache in copy.rglob("__pycache__"):
        subprocess.run(["rm", "-rf", str(cache)], check=True)
    views = copy / "lambdalake" / "views.py"
    views.write_text(views.read_text() + "\nfrom lambdalake.cli import common  # noqa: E402\n")
    result = subprocess.run(
        [str(Path(sys.executable).with_name("lint-imports")), "--no-cache"],
        cwd=copy,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHONPATH": str(copy), "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode != 0, result.stdout[-2000:]
    assert "lambdalake.views -> lambdalake.cli.common" in result.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    """The wheel, built from a copy of the checkout (setuptools leaves build/ where it builds)."""
    src, out = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("wheel")
    for name in ("pyproject.toml", "README.md", "lambdalake", *LAYERS):
        path = PROJECT_ROOT / name
        if path.is_dir():  # the links lambdalake/speed -> ../speed are copied as links
            shutil.copytree(path, src / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(path, src / name)
    pip = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    subprocess.run(
        [*pip, "-w", str(out), str(src)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    (built,) = out.glob("lambdalake-*.whl")
    return zipfile.ZipFile(built)


def test_the_wheel_installs_one_top_level_package(wheel: zipfile.ZipFile) -> None:
    tops = {name.split("/")[0] for name in wheel.namelist()}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"lambdalake"}


def test_the_wheel_holds_every_module_of_the_layers_under_lambdalake(wheel: zipfile.ZipFile) -> None:
    names = set(wheel.namelist())
    expected = {f"lambdalake/{p.relative_to(PROJECT_ROOT / 'lambdalake')}" for p in _sources("lambdalake")}
    for layer in LAYERS:
        expected |= {f"lambdalake/{layer}/{p.relative_to(PROJECT_ROOT / layer)}" for p in _sources(layer)}
    assert expected - names == set()
    # The Maven modules: the services' pom, and the Real-time writer's, built from its sources.
    writer = {
        f"lambdalake/{p.relative_to(PROJECT_ROOT / 'lambdalake')}"
        for p in (PROJECT_ROOT / "lambdalake" / "maven" / "writer").rglob("*")
        if p.is_file() and "target" not in p.parts
    }
    assert writer and {"lambdalake/maven/pom.xml", "lambdalake/spark/log4j2.properties", *writer} <= names


def test_the_layers_import_as_lambdalake_modules_only() -> None:
    code = (
        "import importlib.util, sys\n"
        "import lambdalake.speed.job, lambdalake.batch.job, lambdalake.api.http\n"
        "import lambdalake.infra.services\n"
        "print([n for n in ('speed', 'batch', 'serving', 'infra') if importlib.util.find_spec(n)])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd="/", check=True, timeout=120
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def _sources(folder: str) -> list[Path]:
    root = PROJECT_ROOT / folder
    return [p for p in root.rglob("*.py") if "__pycache__" not in p.parts and not p.is_symlink()]
