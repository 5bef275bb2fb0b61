"""Suite-wide setup: every rank a test starts checks NCCL's rules (restage.runtime.nccl_rules).

``runtime.spawn`` turns the layer on for its children itself; this covers ranks started through
mpirun (``restage run``, ``restage generate``, the e2e jobs), which inherit the environment.
"""

import os

os.environ.setdefault("RESTAGE_NCCL_RULES", "1")
