import sys

from scaleout.cli import main

sys.exit(main())
