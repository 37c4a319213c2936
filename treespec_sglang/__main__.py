import sys

from treespec_sglang.cli import main

sys.exit(main())
