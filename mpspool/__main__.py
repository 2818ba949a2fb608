from mpspool.cli import main

raise SystemExit(main())
