"""``python -m lease_server.cli``: the ``gpulease`` command line."""

from . import main

main()
