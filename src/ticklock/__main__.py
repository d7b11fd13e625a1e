"""``python -m ticklock``: the command-line interface."""

from ._operators.cli import main

raise SystemExit(main())
