"""The README's shell blocks that tests run as written, read from the README by their markers.

``own_database_block``: "Trying it on your own database" (copy the example configuration, seed the
sample, add and promote a key, inventory, run, gate). tests/test_readme_walkthrough.py runs it as a
reader's first block, before the deployment walkthrough in the same shell, and checks what it left.
"""

from __future__ import annotations

import re

from tests.pinprofile import REPO

MARKER = "<!-- walkthrough: own-database -->"


def own_database_block() -> str:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    match = re.search(re.escape(MARKER) + r"\s*```sh\n(.*?)\n```", text, re.DOTALL)
    assert match, f"README.md has no ```sh block after {MARKER}"
    return match.group(1)
