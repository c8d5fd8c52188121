"""Starting jobs: ``sokrun`` (:mod:`~sokpy.launch.sokrun`, mpirun with sokpy's defaults) and
``sokpy-nodes`` (:mod:`~sokpy.launch.emulated_nodes`, a job across emulated nodes). They start
jobs and never run inside one: no layer of the package imports them."""
