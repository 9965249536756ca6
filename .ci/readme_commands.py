"""The README's first code block: the commands of a fresh machine.

Printed one per line (comments dropped), so `.ci/fresh_machine` runs exactly
what a new user reads, and tests/test_fresh_install.py checks the same parse.
"""

from __future__ import annotations

import os
import re
import sys

README = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "README.md")


def readme_commands(path: str = README) -> list[str]:
    with open(path) as f:
        text = f.read()
    block = re.search(r"```bash\n(.*?)```", text, re.S)
    if block is None:
        raise ValueError(f"{path} has no ```bash block")
    commands = []
    for line in block.group(1).splitlines():
        command = re.sub(r"\s+#.*$", "", line).strip()  # a comment after the command
        if command and not command.startswith("#"):
            commands.append(command)
    return commands


if __name__ == "__main__":
    sys.stdout.write("\n".join(readme_commands()) + "\n")
