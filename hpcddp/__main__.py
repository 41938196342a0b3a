import sys

from hpcddp.cli import main

sys.exit(main())
