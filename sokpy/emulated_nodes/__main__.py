"""``python -m sokpy.emulated_nodes``: the ``sokpy-nodes`` command."""

from .cli import main

main()
