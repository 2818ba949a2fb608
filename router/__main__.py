import sys

from mpspool.router.server import main

sys.exit(main())
