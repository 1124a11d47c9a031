"""docs/api.md is the repository's API reference: its citations and its coverage cannot drift.

- Every citation of the form "docs/api.md section N" in the package, the tests, the examples, the
  benchmarks and the Markdown files names a numbered section heading that exists in docs/api.md.
- docs/api.md keeps its section numbering (1, 2, 2b, 3, 4, 5, 5b, 6, ..., 13), so a citation means
  the same thing as long as the numbers are stable.
- docs/api.md names, in code, every public name of ``jagged_sdpa.__all__``, of
  ``jagged_sdpa.distributed.__all__`` and of ``jagged_sdpa.integrations.transformers.__all__``
  (the last read from the module's source, so this test needs no transformers).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import jagged_sdpa
import jagged_sdpa.distributed

ROOT = Path(__file__).resolve().parents[2]
API = ROOT / "docs" / "api.md"

# The section numbers, in order: they match the numbering citations have used all along.
SECTIONS = ("1", "2", "2b", "3", "4", "5", "5b", "6", "7", "8", "9", "10", "11", "12", "13")

HEADING = re.compile(r"^#{2,3} (\d+[a-z]?)\. ", re.M)
# "docs/api.md section 11", "docs/api.md, section 2b", "docs/api.md sections 11"
CITATION = re.compile(r"docs/api\.md,?\s+sections?\s+(\d+[a-z]?)\b")
TEXT_SUFFIXES = {".py", ".md", ".cpp", ".h", ".toml", ".txt", ".cfg", ".rst"}
CODE = re.compile(r"```.*?```|`[^`\n]+`", re.S)


def api_text() -> str:
    return API.read_text()


def headings() -> list[str]:
    return HEADING.findall(api_text())


def cited_files() -> list[Path]:
    """The files whose citations are checked: the package, tests, examples, benchmarks, docs and
    the top-level Markdown files."""
    files = [p for p in ROOT.glob("*.md")]
    for folder in ("jagged_sdpa", "tests", "examples", "benchmarks", "docs"):
        files += [p for p in (ROOT / folder).rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES]
    return sorted(set(files))


def citations() -> list[tuple[str, int, str]]:
    """(file relative to the root, line, section) of every citation of docs/api.md."""
    found = []
    for path in cited_files():
        text = path.read_text(errors="replace")
        for m in CITATION.finditer(text):
            found.append((str(path.relative_to(ROOT)), text.count("\n", 0, m.start()) + 1, m.group(1)))
    return found


def test_the_sections_are_numbered_as_cited():
    assert tuple(headings()) == SECTIONS


def test_every_citation_names_an_existing_section():
    existing = set(headings())
    wrong = [f"{path}:{line}: docs/api.md section {n}" for path, line, n in citations() if n not in existing]
    assert not wrong, "citations of sections docs/api.md does not have:\n" + "\n".join(wrong)


def test_the_citation_pattern_finds_citations():
    """The checker is not vacuous: the pattern recognises the citation forms."""
    sample = "see docs/api.md section 11 and docs/api.md, section 2b; also docs/api.md sections 12"
    assert CITATION.findall(sample) == ["11", "2b", "12"]
    old_form = "API" + ".md"  # spelled apart: a rewrite of the old citations must leave this line alone
    assert CITATION.findall(f"{old_form} 11, {old_form} section 12") == []


def _module_all(path: Path) -> list[str]:
    """``__all__`` of a module, read from its source without importing it."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise AssertionError(f"{path} has no __all__")


def _missing(names) -> list[str]:
    code = "\n".join(m.group(0) for m in CODE.finditer(api_text()))
    return [n for n in names if not re.search(rf"(?<![\w]){re.escape(n)}(?!\w)", code)]


def test_every_public_name_is_documented():
    assert not _missing(jagged_sdpa.__all__), "jagged_sdpa.__all__ names missing from docs/api.md"


def test_the_distributed_and_transformers_names_are_documented():
    names = list(jagged_sdpa.distributed.__all__)
    names += _module_all(ROOT / "jagged_sdpa" / "integrations" / "transformers" / "__init__.py")
    assert not _missing(names), "public names missing from docs/api.md"


def test_the_index_lists_every_section():
    index = (ROOT / "docs" / "README.md").read_text()
    listed = re.findall(r"^\| (\d+[a-z]?) \|", index, re.M)
    assert tuple(listed) == SECTIONS
