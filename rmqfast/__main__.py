from rmqfast.cli import main

raise SystemExit(main())
