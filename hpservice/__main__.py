import sys

from hpservice.cli import main

sys.exit(main())
