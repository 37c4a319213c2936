"""``python -m treespec_sglang.cli``: the ``treespec`` command without its console script."""

import sys

from . import main

sys.exit(main())
