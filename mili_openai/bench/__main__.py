"""`python -m mili_openai.bench serve ...` (the same command as `mili bench serve`)."""

import sys

from mili_openai.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
