"""README.md's Python code blocks, found by the section they stand in, for the tests that run them.

Every ```python block of the README is run by a test (tests/test_readme.py; the three of the "Frameworks"
section, which need Lightning, accelerate and transformers, by tests/integrations/test_readme_snippets.py),
with a preamble that makes what the block takes as given (a `model`, a `loss`, `data`) and a check of what its
comments claim. A block is named by its section's heading and its place in that section: a block added, moved
or removed fails test_every_readme_snippet_is_run until SNIPPETS here says where it is run.

The blocks run on the CPU: a device named "cuda" in a block becomes "cpu" (on_cpu)."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"

# (section heading, index of the block within the section) -> the test file that runs it
SNIPPETS = {
    ("Quickstart", 0): "tests/test_readme.py",
    ("GradScaler", 0): "tests/test_readme.py",
    ("Fused optimizers", 0): "tests/test_readme.py",
    ("LAMB and Lion", 0): "tests/test_readme.py",
    ("Fewer bytes per param: remainders and stochastic rounding", 0): "tests/test_readme.py",
    ("Mixed precision in one call: `mpfused.amp`", 0): "tests/test_readme.py",
    ("GEMM and FusedLinear", 0): "tests/test_readme.py",
    ("Stochastic rounding", 0): "tests/test_readme.py",
    ("Fixed point (Gupta et al. 2015)", 0): "tests/test_readme.py",
    ("torch.compile, CUDA graphs, torch operators", 0): "tests/test_readme.py",
    ("Frameworks", 0): "tests/integrations/test_readme_snippets.py",
    ("Frameworks", 1): "tests/integrations/test_readme_snippets.py",
    ("Frameworks", 2): "tests/integrations/test_readme_snippets.py",
    ("Distributed training", 0): "tests/test_readme.py",
}


def python_blocks(text: str | None = None) -> dict[tuple[str, int], str]:
    """Every ```python block of the README: (heading of its section, its index there) -> its code."""
    text = README.read_text() if text is None else text
    blocks: dict[tuple[str, int], str] = {}
    heading, count = "", 0
    fence, code = None, []  # the fence's language while inside one (a bash block's "# ..." is no heading)
    for line in text.splitlines():
        stripped = line.strip()
        if fence is not None:
            if stripped == "```":
                if fence == "python":
                    blocks[(heading, count)] = "\n".join(code) + "\n"
                    count += 1
                fence, code = None, []
            elif fence == "python":
                code.append(line)
        elif stripped.startswith("```"):
            fence = stripped[3:].strip()
        elif line.startswith("#"):
            heading, count = line.lstrip("#").strip(), 0
    return blocks


def block(heading: str, index: int = 0) -> str:
    return python_blocks()[(heading, index)]


def on_cpu(code: str) -> str:
    """The block with every device named "cuda" (a string literal) named "cpu"."""
    return re.sub(r"""(["'])cuda\1""", r"\1cpu\1", code)
