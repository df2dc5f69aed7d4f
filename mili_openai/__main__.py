"""`python -m mili_openai serve ...` is the `mili` command."""

import sys

from mili_openai.cli import main

if __name__ == "__main__":
    sys.exit(main())
