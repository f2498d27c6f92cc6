import sys

from asyncengine.cli import main

sys.exit(main())
