import sys

from hpc.cli import main

sys.exit(main())
