"""``python -m sokpy.launch.emulated_nodes``: the ``sokpy-nodes`` command."""

from .cli import main

main()
