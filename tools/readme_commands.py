#!/usr/bin/env python3
"""README.md's two commands, as the README writes them: `readme_commands.py 1` prints the first
(set up and run the demo), `readme_commands.py 2` the second (set up and run the tests).

They are the first two ```bash blocks under the "## Two commands" heading; .ci/run runs them,
so CI runs exactly what a new user copies from the README.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_commands(text: str) -> list[str]:
    section = text.split("## Two commands", 1)
    if len(section) < 2:
        raise SystemExit("README.md has no '## Two commands' section")
    body = re.split(r"^## ", section[1], maxsplit=1, flags=re.MULTILINE)[0]
    blocks = [b.strip() for b in re.findall(r"```bash\n(.*?)```", body, flags=re.DOTALL)]
    if len(blocks) < 2:
        raise SystemExit("README.md's '## Two commands' section must hold two ```bash blocks")
    return blocks[:2]


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in ("1", "2"):
        raise SystemExit("usage: readme_commands.py 1|2")
    print(readme_commands(README.read_text())[int(sys.argv[1]) - 1])
