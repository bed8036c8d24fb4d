"""The documentation's runnable code blocks run, so README.md and docs/*.md cannot rot.

A fenced block is runnable when the line just before its opening fence is the marker
``<!-- runnable -->`` (docs/README.md, "Runnable blocks"):

- a ``bash`` / ``sh`` block runs under ``bash -euo pipefail`` and must exit 0;
- a ``python`` block runs as a script and must exit 0 (its ``assert``s are the checks);
- a ``console`` block is a transcript: each ``$ command`` (continued by a trailing
  backslash) runs, and what it prints (stdout and stderr, as a terminal shows them)
  must equal the lines after it, where a line ``...`` stands for any number of lines.

Every block runs in a fresh process from the repository root, with this checkout first
on ``PYTHONPATH``, ``memory-estimator`` and ``python`` on ``PATH`` resolving to this
checkout and this interpreter, and ``TMPDIR`` a directory of its own. Blocks without the
marker are illustrations (they name a model or a cluster the reader has) and are left alone.

``python`` and ``memory-estimator`` here are forks of one interpreter that has imported torch,
shardengine and memory_estimator (``preloaded_python.py``, its Note says what a fork keeps of
a fresh interpreter): the blocks start about sixty Python processes, each of which spent
~4.5 s of CPU importing those before running a line of the block.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest
from preloaded_python import PreloadedPython

ROOT = Path(__file__).resolve().parents[2]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = "<!-- runnable -->"
LANGUAGES = {"bash": "bash", "sh": "bash", "python": "python", "console": "console"}
BLOCK_TIMEOUT_S = 300


@dataclass(frozen=True)
class Block:
    path: Path
    line: int          # 1-based line of the opening fence
    language: str      # bash, python or console
    text: str

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def runnable_blocks(path: Path) -> list[Block]:
    """The marked blocks of one Markdown file; a marker not followed by a known fence is an error."""
    lines = path.read_text().split("\n")
    blocks = []
    for i, line in enumerate(lines):
        if line.strip() != MARKER:
            continue
        where = f"{path.relative_to(ROOT)}:{i + 1}"
        fence = lines[i + 1].strip() if i + 1 < len(lines) else ""
        language = LANGUAGES.get(fence[3:].strip()) if fence.startswith("```") else None
        if language is None:
            raise ValueError(f"{where}: {MARKER} must be followed by a ```bash, ```sh, ```python or "
                             f"```console fence, found {fence!r}")
        end = next((j for j in range(i + 2, len(lines)) if lines[j].strip() == "```"), None)
        if end is None:
            raise ValueError(f"{where}: the block after {MARKER} is never closed")
        blocks.append(Block(path, i + 2, language, "\n".join(lines[i + 2:end]) + "\n"))
    return blocks


def all_blocks() -> list[Block]:
    return [block for path in DOC_FILES for block in runnable_blocks(path)]


# ------------------------------------------------------------------------- transcripts


def parse_transcript(text: str) -> list[tuple[str, list[str]]]:
    """``$ command`` lines (joined over trailing backslashes) and the output expected after each."""
    steps: list[tuple[str, list[str]]] = []
    lines = text.rstrip("\n").split("\n")
    i = 0
    while i < len(lines):
        if not lines[i].startswith("$ "):
            raise ValueError(f"a console block must start with '$ command', found {lines[i]!r}")
        command = lines[i][2:]
        while command.endswith("\\") and i + 1 < len(lines):
            i += 1
            command = command[:-1].rstrip() + " " + lines[i].strip()
        i += 1
        output = []
        while i < len(lines) and not lines[i].startswith("$ "):
            output.append(lines[i])
            i += 1
        steps.append((command, output))
    return steps


def output_matches(expected: list[str], actual: list[str]) -> bool:
    """Line by line, trailing spaces ignored; an expected line ``...`` matches any run of lines."""
    pattern = "".join(r"(?:.*\n)*?" if line.strip() == "..." else re.escape(line.rstrip()) + r"\n"
                      for line in expected)
    text = "".join(line.rstrip() + "\n" for line in actual)
    return re.fullmatch(pattern, text) is not None


def test_output_matching_rules():
    assert output_matches(["a", "...", "d"], ["a", "b", "c", "d  "])
    assert output_matches(["a", "...", "b"], ["a", "b"])
    assert not output_matches(["a", "b"], ["a", "b", "c"])
    assert not output_matches(["a", "...", "d"], ["a", "b", "c"])
    assert parse_transcript("$ echo a \\\n    b\na b\n") == [("echo a b", ["a b"])]


# ------------------------------------------------------------------------- running


@pytest.fixture(scope="module")
def doc_env(tmp_path_factory) -> Iterator[dict[str, str]]:
    """This checkout and this interpreter first, whatever is installed; ``python`` preloaded."""
    bin_dir = tmp_path_factory.mktemp("doc_bin")
    env = dict(os.environ)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["COLUMNS"] = "80"                  # argparse wraps --help to the terminal width
    for launcher_variable in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                              "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS"):
        env.pop(launcher_variable, None)   # a block at world size 1 must not join a job around the test
    env["PYTHON_EXEC"] = str(bin_dir / "python")  # torchrun starts its ranks with this (its docs)
    with PreloadedPython(env, cwd=str(ROOT)) as preloaded:
        preloaded.write_shims(bin_dir)
        yield preloaded.env


def run(argv: list[str], env: dict[str, str], tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=ROOT, env={**env, "TMPDIR": str(tmp_path)}, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=BLOCK_TIMEOUT_S)


BLOCKS = all_blocks()


# ------------------------------------------------------------------------- links and paths

REPO_FOLDERS = ("shardengine", "memory_estimator", "tests", "benchmarks", "examples", "scripts", "docs")
GENERATED = ("benchmarks/results/",)   # written by the benchmarks, ignored by git
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`([^`\s]+)`")


def prose_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of the lines outside fenced code blocks."""
    lines, inside = [], False
    for number, line in enumerate(path.read_text().split("\n"), 1):
        if line.lstrip().startswith("```"):
            inside = not inside
        elif not inside:
            lines.append((number, line))
    return lines


def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens; repeats get -1, -2."""
    seen: dict[str, int] = {}
    for _, line in prose_lines(path):
        if match := re.match(r"#{1,6} +(.*?)#*$", line):
            slug = re.sub(r"[^\w\- ]", "", match.group(1).strip().lower()).replace(" ", "-")
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            if count:
                seen[f"{slug}-{count}"] = 1
    return set(seen)


def broken_references(path: Path) -> list[str]:
    broken = []
    for number, line in prose_lines(path):
        for target in LINK.findall(line):
            if re.match(r"[a-z]+:", target):
                continue                        # http(s), mailto: not checked offline
            file_part, _, anchor = target.partition("#")
            linked = (path.parent / file_part).resolve() if file_part else path
            if not linked.exists():
                broken.append(f"{number}: link to a missing file {target}")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                broken.append(f"{number}: link to a missing heading {target}")
        for span in (span.split("::")[0] for span in CODE_SPAN.findall(line)):  # a pytest node id: its file
            # a path whose folder is not here names another repository's file (a cited source)
            if (span.split("/")[0] in REPO_FOLDERS and "/" in span and not span.startswith(GENERATED)
                    and (ROOT / span.rstrip("/")).parent.exists() and not list(ROOT.glob(span.rstrip("/")))):
                broken.append(f"{number}: `{span}` does not exist")
    return broken


@pytest.mark.parametrize("path", DOC_FILES, ids=[str(p.relative_to(ROOT)) for p in DOC_FILES])
def test_links_and_paths_exist(path: Path):
    assert not broken_references(path), broken_references(path)


def test_link_checker_catches_a_missing_heading(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# A `code` title: here\n\n[ok](#a-code-title-here) [bad](#nowhere) [gone](other.md)\n")
    assert broken_references(page) == ["3: link to a missing heading #nowhere", "3: link to a missing file other.md"]


def test_docs_have_runnable_blocks():
    """The marker is found (a parser that found nothing would make the test below vacuous)."""
    assert len(BLOCKS) >= 20, [block.name for block in BLOCKS]
    assert {block.language for block in BLOCKS} == {"bash", "python", "console"}


@pytest.mark.parametrize("block", BLOCKS, ids=[block.name for block in BLOCKS])
def test_runnable_block(block: Block, doc_env, tmp_path):
    if block.language == "console":
        for command, expected in parse_transcript(block.text):
            result = run(["bash", "-c", command], doc_env, tmp_path)
            actual = result.stdout.rstrip("\n").split("\n")
            assert output_matches(expected, actual), (
                f"{block.name}: `{command}` (exit {result.returncode}) printed\n{result.stdout}\n"
                f"where the document shows\n" + "\n".join(expected))
        return
    script = tmp_path / ("block.py" if block.language == "python" else "block.sh")
    script.write_text(block.text)
    argv = ["python", str(script)] if block.language == "python" else ["bash", "-euo", "pipefail", str(script)]
    result = run(argv, doc_env, tmp_path)
    assert result.returncode == 0, f"{block.name} exited {result.returncode}:\n{result.stdout}"
