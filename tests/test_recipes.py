"""The recipes of book/use.md ("Use one encoding in your own model"), executed as the page shows them.

Each ``python`` block of the page runs alone in a fresh namespace: a reader can copy any one of them. The
blocks carry their own checks (``assert``), so the page and this test cannot drift apart.
"""

import re
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parents[1] / "book" / "use.md"


def recipes() -> dict[str, str]:
    """The page's python blocks, each named by the heading above it."""
    text, found, heading = PAGE.read_text(), {}, "intro"
    for match in re.finditer(r"^## ([^\n]+)$|^```python\n(.*?)^```$", text, flags=re.M | re.S):
        if match.group(1):
            heading = match.group(1).strip()
        else:
            found[heading] = match.group(2)
    return found


RECIPES = recipes()


def test_the_page_has_the_three_recipes():
    assert len(RECIPES) == 3
    rope, alibi, trained = RECIPES.values()
    assert "scaled_inv_freq(\"yarn\"" in rope and "scaled_dot_product_attention" in alibi and ".backward()" in trained


@pytest.mark.parametrize("heading", list(RECIPES))
def test_recipe_runs_as_written(heading):
    exec(compile(RECIPES[heading], f"book/use.md: {heading}", "exec"), {"__name__": "recipe"})


def test_the_page_is_in_the_table_of_contents():
    toc = (PAGE.parents[1] / "_toc.yml").read_text()
    assert "file: book/use" in toc
