"""``python -m pyllama_spec.native_build``: the same as ``python build.py``."""

import sys

from . import main

sys.exit(main())
