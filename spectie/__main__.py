from spectie.cli import main

raise SystemExit(main())
