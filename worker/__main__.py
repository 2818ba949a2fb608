import sys

from mpspool.worker.serve import main

sys.exit(main())
