import sys

from lmforge.cli.main import main

sys.exit(main())
