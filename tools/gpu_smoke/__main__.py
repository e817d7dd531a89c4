"""`python -m tools.gpu_smoke`: see tools/gpu_smoke/run.py."""

import sys

from tools.gpu_smoke.run import main

sys.exit(main())
