"""``python -m ckptcache.cli``: the ``ckptcache`` command."""

import sys

from ckptcache.cli.commands import main

sys.exit(main())
