"""Emulated nodes: several "nodes" on one Linux machine, joined by a rate-limited network, for
running and measuring multi-node jobs without a cluster (root only).

A node is a network namespace with its own hostname. Each node has one virtual ethernet
link to a switch (a bridge inside a namespace of its own), shaped in both directions with
``tc ... tbf`` at the given rate. ``mpirun`` runs on the first node and starts its daemon
on every other node through a launch agent (instead of ssh) that enters that node's
namespace and sets its hostname; Open MPI's TCP transport and out-of-band channel are held
to the emulated subnet. With ``--launcher torchrun`` every node runs torchrun's own
agent instead (``--nnodes N --node-rank i``), node0's holding the job's store on node0's
address, and the workers' gloo uses each node's link. Nothing is added to the machine's own
network namespace.

A run is named ``sokpyn<pid>-<k>`` (the pid of the process that made it) and its namespaces
``<run>-switch``, ``<run>-node0``, ...; a record in ``/run/sokpy-nodes/<run>.json`` names
them and the process that made them. When the run ends (the job finishes, fails, times out,
or sokpy-nodes gets SIGINT, SIGTERM or SIGHUP), every process inside its namespaces is ended
(SIGTERM, then SIGKILL after a few seconds): mpirun, the daemons on the other nodes and
every rank. Then the namespaces and the record are removed. Only a run whose process was
killed outright (SIGKILL) leaves anything behind; ``--cleanup`` removes that.

From the shell (``sokpy-nodes``, also ``launch/sokpy-nodes``)::

    sokpy-nodes --nodes 2 --ranks-per-node 2 --rate 1gbit -- python train.py
    sokpy-nodes --nodes 2 --ranks-per-node 2 --launcher torchrun -- python train.py
    sokpy-nodes --cleanup              # runs whose sokpy-nodes is gone (killed)
    sokpy-nodes --cleanup sokpyn4242-0 # that run, even while its sokpy-nodes still runs

``--cleanup`` ends the processes and removes the namespaces, record and folder of the runs it is
given, or with no run given, of every recorded run whose process is gone. Runs still alive
and ``sokpyn`` namespaces without a record (made by someone else) are left alone unless
named.

From Python (tests, benchmarks)::

    from sokpy.launch.emulated_nodes import EmulatedNodes
    with EmulatedNodes(nodes=2, rate="10gbit") as cluster:

The parts:

* :mod:`sokpy.launch.emulated_nodes.runs`: the runs on this machine: their namespaces, records and
  processes, and their removal (:func:`cleanup`, :func:`end_processes`, :func:`available`);
* :mod:`sokpy.launch.emulated_nodes.resources`: what a run is given: a free subnet, each node's
  cores, the token bucket of a link's rate (:func:`rate_bits`, :func:`default_burst`);
* :mod:`sokpy.launch.emulated_nodes.cluster`: :class:`EmulatedNodes` (build, run a job, tear down)
  and :class:`Interrupted`;
* :mod:`sokpy.launch.emulated_nodes.cli`: the ``sokpy-nodes`` command (:func:`main`), which
  ``__main__`` runs for ``python -m sokpy.launch.emulated_nodes``.
"""

from .cli import main
from .cluster import EmulatedNodes, Interrupted
from .resources import default_burst as default_burst
from .resources import rate_bits as rate_bits
from .runs import PREFIX as PREFIX
from .runs import RECORDS as RECORDS
from .runs import all_namespaces as all_namespaces
from .runs import available, cleanup, end_processes
from .runs import pids_in as pids_in
from .runs import run_of as run_of

__all__ = ["EmulatedNodes", "Interrupted", "available", "cleanup", "end_processes", "main"]
