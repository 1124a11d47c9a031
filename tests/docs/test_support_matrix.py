"""The README's feature x backend table must match the declared Capabilities."""

from pathlib import Path

from jagged_sdpa import support_matrix

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_matrix_is_current():
    text = README.read_text()
    assert support_matrix.BEGIN in text and support_matrix.END in text
    assert support_matrix.replace_in(text) == text, (
        "README support matrix is stale: run python -m jagged_sdpa.support_matrix --write README.md")


def test_matrix_has_every_backend_and_math_supports_everything():
    table = support_matrix.render()
    header = table.splitlines()[1]
    for name in ("flash_varlen", "efficient", "triton", "math"):
        assert f"`{name}`" in header
    math_column = [row.split("|")[-2].strip() for row in table.splitlines()[3:] if row.startswith("| ")]
    assert "—" not in math_column[4:]
