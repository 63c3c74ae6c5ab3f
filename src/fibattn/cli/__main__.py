"""``python -m fibattn.cli``: the same as the ``fibattn`` command."""
import sys

from . import main

sys.exit(main())
