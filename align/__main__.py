import sys

from align.cli import main

sys.exit(main())
