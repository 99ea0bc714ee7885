"""Settings for every test process (and the subprocesses they start, through the environment)."""

import os
import tempfile

# MindFormers writes ./output/log when imported unless told where: keep it out of the work tree.
os.environ.setdefault("LOCAL_DEFAULT_PATH", os.path.join(tempfile.gettempdir(), "xf-align-mf-output"))
