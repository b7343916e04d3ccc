"""__main__.py: ``python -m offload [--dir DIR] [--json]``, the environment report of
offload/doctor.py."""
import sys

import offload
from offload.doctor import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], offload.build_info))
