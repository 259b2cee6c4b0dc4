"""``python -m dist_runtime.cli``: the ``dist-runtime`` command."""

from . import main

raise SystemExit(main())
