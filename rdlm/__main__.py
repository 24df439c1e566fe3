from rdlm.cli import main

raise SystemExit(main())
