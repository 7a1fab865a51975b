"""A stage script run with extra arguments on torchrun rank 1 alone: a node that reads another config or another
command line, for the tests of ranks that disagree (tests/train/test_ddp.py, tests/prompts/test_replicas.py,
tests/capture/test_extract_distributed.py).

``torchrun ... tests/_rank1_args.py SCRIPT ARGS...`` runs ``SCRIPT ARGS...`` on every rank, with the whitespace-split
``RANK1_EXTRA`` environment variable appended to rank 1's arguments.
"""

import os
import runpy
import sys

script, *args = sys.argv[1:]
if os.environ.get("RANK") == "1":
    args += os.environ["RANK1_EXTRA"].split()
sys.argv = [script, *args]
runpy.run_path(script, run_name="__main__")
