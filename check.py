"""Check your own work on a step of the course, at any moment: which TODOs work, which to fix.

    python check.py                    # list the steps
    python check.py ddp                # train/to_distributed_training.py, TODOs 1-11
    python check.py sbatch --show      # what the job file would start on every node
    python check.py ddp --hint 5       # a hint for TODO 5 (again: a more detailed one)

The check itself lives in selfcheck/ (one module per step); this file is its entry point.
"""

import sys

from selfcheck.cli import main

if __name__ == "__main__":
    sys.exit(main())
