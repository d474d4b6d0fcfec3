"""The README's whole programs (its ``python`` blocks that end in ``asyncio.run(main())``): run
on a device by ``tests/rxe/test_readme_examples.py``, counted without one by
``tests/unit/test_suite_rules.py``."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.DOTALL)
PROGRAMS = [b for b in BLOCKS if "asyncio.run(main())" in b]
