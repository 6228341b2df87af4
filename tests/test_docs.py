"""The documentation: the site builds strictly (a broken link or anchor fails), the README stays a
README, and every `lambdalake …` and `make …` command the docs show exists, with its options."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import typer.main
from typer.testing import CliRunner

from lambdalake.cli import app
from lambdalake.settings import PROJECT_ROOT

PAGES = [*sorted((PROJECT_ROOT / "docs").glob("*.md")), PROJECT_ROOT / "README.md"]
PAGES.append(PROJECT_ROOT / "BENCHMARKS.md")
OPTION = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def _mkdocs(root: Path, site: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(Path(sys.executable).with_name("mkdocs")), "build", "--strict", "-d", str(site)],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    result = _mkdocs(PROJECT_ROOT, tmp_path / "site")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert (tmp_path / "site" / "operations" / "index.html").exists()
    current = (tmp_path / "site" / "benchmarks" / "index.html").read_text()
    assert "Current figures" in current, "the benchmarks page lost BENCHMARKS.md's table"


def test_a_broken_link_fails_the_build(tmp_path: Path) -> None:
    """The same build on a copy with one link to an anchor no page has: it fails, naming the link."""
    root = tmp_path / "copy"
    shutil.copytree(PROJECT_ROOT / "docs", root / "docs")
    shutil.copy(PROJECT_ROOT / "mkdocs.yml", root / "mkdocs.yml")
    shutil.copy(PROJECT_ROOT / "BENCHMARKS.md", root / "BENCHMARKS.md")
    index = root / "docs" / "index.md"
    index.write_text(index.read_text() + "\n[gone](layers.md#no-such-section)\n")
    result = _mkdocs(root, tmp_path / "site")
    assert result.returncode != 0
    assert "no-such-section" in result.stdout + result.stderr


def test_the_readme_is_a_readme() -> None:
    lines = (PROJECT_ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines: move the detail to docs/"
    assert lines[2] == "```bash" and lines[5] == "```"
    assert lines[3].startswith("make demo   # set up everything on a fresh machine")
    assert lines[4].startswith("make test   # set up everything on a fresh machine")


def _command_lines() -> list[tuple[str, str]]:
    """Every `lambdalake …` the docs show: lines of code blocks, and inline code spans."""
    found = []
    for page in PAGES:
        fence = False
        for line in page.read_text().splitlines():
            if line.lstrip().startswith("```"):
                fence = not fence
                continue
            if fence:
                text = line.strip().removeprefix("$ ")
                if text.startswith("lambdalake "):
                    found.append((page.name, re.split(r"\s{3,}", text)[0]))
            else:
                found += [(page.name, span) for span in re.findall(r"`(lambdalake [^`]+)`", line)]
    return found


COMMANDS = _command_lines()


def _resolve(words: list[str]) -> list[list[str]]:
    """The command paths a line names (``up | down | status`` names three)."""
    root = typer.main.get_command(app)
    paths: list[list[str]] = []
    group, path, i = root, [], 0
    while i < len(words) and hasattr(group, "commands") and words[i] in group.commands:
        names = [words[i]]
        while i + 2 < len(words) and words[i + 1] == "|" and words[i + 2] in group.commands:
            names.append(words[i + 2])
            i += 2
        if len(names) > 1:
            return [[*path, n] for n in names]
        path.append(words[i])
        group = group.commands[words[i]]
        i += 1
    paths.append(path)
    return paths


def test_the_docs_show_commands() -> None:
    assert len(COMMANDS) > 40, COMMANDS
    pages = {page for page, _ in COMMANDS}
    assert {"README.md", "operations.md", "production.md"} <= pages


@pytest.mark.parametrize(("page", "line"), COMMANDS, ids=[f"{p}:{line[:60]}" for p, line in COMMANDS])
def test_every_command_the_docs_show_exists(page: str, line: str) -> None:
    words = line.replace("[", " ").replace("]", " ").split()[1:]
    paths = _resolve(words)
    runner = CliRunner()
    for path in paths:
        # `lambdalake --help`, `lambdalake <command> --help`: the root's help
        assert path or words[0].startswith(("<", "--")), f"{page}: `{line}` names no lambdalake command"
        result = runner.invoke(app, [*path, "--help"])
        assert result.exit_code == 0, f"{page}: `lambdalake {' '.join(path)} --help` failed:\n{result.output}"
    command = typer.main.get_command(app)
    for word in paths[0]:
        command = command.commands[word]  # type: ignore[attr-defined]
    known = {"--help"} | {o for p in command.params for o in (*p.opts, *p.secondary_opts)}
    unknown = sorted(set(OPTION.findall(line)) - known)
    assert not unknown, f"{page}: `{line}` shows options `lambdalake {' '.join(paths[0])}` lacks: {unknown}"


def test_every_make_target_the_docs_show_exists() -> None:
    makefile = (PROJECT_ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][a-z-]*):", makefile, flags=re.M))
    shown = set()
    for page in PAGES:
        text = page.read_text()
        shown |= set(re.findall(r"`make ([a-z][a-z-]*)", text))
        shown |= set(re.findall(r"^make ([a-z][a-z-]*)", text, flags=re.M))
    assert shown and shown - targets == set(), (
        f"make targets the docs show but the Makefile lacks: {shown - targets}"
    )
