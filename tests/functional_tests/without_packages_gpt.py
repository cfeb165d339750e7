"""pretrain_gpt.py in a process where some modules cannot be imported (for the missing-package tests).

Usage: python without_packages_gpt.py <module[,module...]> <Megatron flags...>
Each named module is set to None in ``sys.modules``, so importing it raises ModuleNotFoundError
as on a machine without that package; then pretrain_gpt.py runs as the main script.
"""

import os
import runpy
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    for name in sys.argv.pop(1).split(","):
        sys.modules[name] = None
    runpy.run_path(os.path.join(REPO, "pretrain_gpt.py"), run_name="__main__")


if __name__ == "__main__":
    main()
