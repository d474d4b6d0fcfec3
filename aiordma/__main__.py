import sys

from aiordma.tools.cli import main

sys.exit(main())
