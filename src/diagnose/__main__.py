import sys

from src.diagnose.cli import main

sys.exit(main())
