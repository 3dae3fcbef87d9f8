import sys

from hpc.verbs import main

sys.exit(main())
