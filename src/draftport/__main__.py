import sys

from draftport.cli import main

sys.exit(main())
