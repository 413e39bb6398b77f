import sys

from pdserve.cli.main import main

# Guarded: multiprocessing's spawn re-imports the main module in every child it starts.
if __name__ == "__main__":
    sys.exit(main())
