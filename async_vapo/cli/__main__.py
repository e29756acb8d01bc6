import sys

from async_vapo.cli import main

sys.exit(main())
