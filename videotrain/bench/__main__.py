import sys

from videotrain.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
