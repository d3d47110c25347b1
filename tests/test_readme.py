"""README.md's Python code blocks run as written, so the documentation cannot drift from the code.

Each block runs in a fresh interpreter, in a folder where the file names it uses
(t.gguf, m.gguf, d.gguf, photo.png) are the tiny models and a picture.
"""

from __future__ import annotations

import re
import shutil

import pytest
from conftest import REPO_ROOT

BLOCKS = re.findall(r"```python\n(.*?)```", (REPO_ROOT / "README.md").read_text(), flags=re.DOTALL)


def test_the_readme_has_python_blocks():
    assert BLOCKS and any("ps.load" in b for b in BLOCKS)


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_python_block_runs_as_written(index, tiny_dense, big_image_png, run_python, tmp_path):
    for name, src in (("t.gguf", tiny_dense.target), ("m.gguf", tiny_dense.mmproj), ("d.gguf", tiny_dense.draft),
                      ("photo.png", big_image_png)):
        shutil.copy(src, tmp_path / name)
    res = run_python(BLOCKS[index], cwd=tmp_path, timeout=300)
    assert res.returncode == 0, f"README block {index} failed:\n{BLOCKS[index]}\n{res.stderr[-3000:]}"
