from ctxfuse.cli import main

raise SystemExit(main())
