"""The parts of ``launch/gpu-check``, the device path's proof on a GPU node: ``runner`` (steps
as processes under time limits, the log), ``node`` (the checkout's name, the node's
conditions that ``--emulate`` recreates), ``results`` (bit-for-bit comparisons, the summary),
and the two probes it runs in processes of their own, ``environment.py`` and
``nvrtc_build.py``. They need the Python standard library and numpy only."""
