"""Sparse optimizers for sokpy tables: SGD, Adagrad, row-wise Adagrad, FTRL and lazy Adam, as fused
kernels.

They follow torch.optim: ``step()``, ``zero_grad()``, ``param_groups`` (with a mutable
``"lr"``, so ``torch.optim.lr_scheduler`` works), ``add_param_group``, ``state_dict()`` /
``load_state_dict()`` (hyper-parameters, step counts and this rank's slots, with the rank,
world size and tables they were taken at: a per-rank ``torch.save``/``torch.load`` resumes
exactly; the states of every rank reshard at another world size; a state loaded where it does
not belong, such as rank 0's on every rank, is refused on every rank; ``sokpy.save`` /
``sokpy.load`` reshard too). State slots (accumulators, linear terms, moments) live beside the
rows in the table's storage and are created when the table joins the optimizer, so the memory
is claimed up front. ``opt.state[var.handle]`` shows them as views ``[local rows, dim]``
(``[local rows, 1]`` for a row-wise slot: RowWiseAdagrad's accumulator).

``step()`` is collective and costs a fixed number of launches whatever the number of tables:
it merges the gradient rows that arrived for each row (from every rank and every backward
since ``zero_grad``), refuses on every rank alike, before any change, a merged gradient that
is not finite, then runs one fused update kernel for all its tables. Rows without a
gradient are not touched. The numerics are in ``docs/numerics.md``. With ``fused=True``
(FBGEMM's and TorchRec's optimizer fused into the backward) the update runs inside each
lookup's backward instead, where the gradient rows are summed, and no gradient is held
(:mod:`sokpy.optim.in_backward`); ``step()`` then only runs its closure.

The package's parts: :mod:`sokpy.optim.base` (:class:`SparseOptimizer`: param groups, each
table's state, the step), :mod:`sokpy.optim.state` (``state_dict`` and ``load_state_dict``:
where a state was taken, and its load, resharded or refused) and :mod:`sokpy.optim.kinds` (the
update rules, one class each). The gradient entries a step applies are assembled in :mod:`sokpy.exchange.gradients`
(``collect_entries``, ``merge_entries``).

Dense parameters keep their own torch optimizer (two-optimizer pattern)::

    emb_opt = sokpy.optim.Adagrad([user, item], lr=0.05)
    dense_opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss.backward()
    emb_opt.step(); dense_opt.step()
    emb_opt.zero_grad(); dense_opt.zero_grad()
"""

from .base import SparseOptimizer
from .kinds import SGD, Adagrad, Adam, Ftrl, RowWiseAdagrad

__all__ = ["SparseOptimizer", "SGD", "Adagrad", "RowWiseAdagrad", "Ftrl", "Adam"]
