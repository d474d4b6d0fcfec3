import sys

from aiordma.cli import main

sys.exit(main())
