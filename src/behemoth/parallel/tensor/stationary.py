"""Which form a tensor-parallel Linear takes without autograd (generation): weight-stationary, its
weight blocks left in place and the tokens moved, or the training forward, its weights gathered.
Shapes alone decide, so every rank of a grid or cube chooses alike. Pure (no torch): the runtime's
layers (:mod:`.grid`, :mod:`.tp3d`) and the planner's generation model read the same rules.

Tested in tests/dist/test_tp2d_layers.py and tests/dist/test_tp3d_layers.py.
"""

from __future__ import annotations

__all__ = ["cube_stationary_is_cheaper", "grid_stationary_is_cheaper"]


def grid_stationary_is_cheaper(rows: int, n_in: int, n_out: int, q: int) -> bool:
    """Whether :func:`.grid.stationary_linear` moves fewer elements per rank than :func:`.grid.summa_linear`
    for a local input of ``rows x n_in`` and a weight block of ``n_in x n_out``. SUMMA receives
    the input's ``(q-1) rows n_in`` and the weight column's ``(q-1) n_in n_out``; the
    weight-stationary form the input's ``q rows n_in`` (its own block too, but for the diagonal)
    and the reduce-scatter's ``(q-1) rows n_out``: it wins while the tokens are few (a decode
    step: Llama-3-8B at q = 2 below 1,024 rows a rank), SUMMA for a prompt's many. Every rank of
    a grid holds the same shapes, so all choose alike."""
    return rows * n_in + (q - 1) * rows * n_out < (q - 1) * n_in * n_out


def cube_stationary_is_cheaper(rows: int, n_in: int, n_out: int, q: int) -> bool:
    """Whether :func:`.tp3d.stationary_linear` moves fewer elements per rank than
    :func:`.tp3d.gathered_linear` for a local input of ``rows x n_in`` (``n_in = K/q``) and a weight
    block of ``n_out x n_in`` (``n_out = N/q**2``). The training forward receives the input's
    ``(q-1) rows n_in`` over I, the weight's ``(q-1) n_in n_out`` over W and the reduce-scatter's
    ``(q-1) q rows n_out`` over O; the weight-stationary form ``(q**2-1) rows (n_in + n_out)``
    (the input of the whole (I, W) plane, its reduce-scatter and all-to-all): it wins while
    ``rows (q n_in + n_out) < n_in n_out``, i.e. while the tokens are few (a decode step:
    Llama-3-8B at q = 2 up to 120 rows a rank for k_proj, 409 for q_proj, 955 for gate / up),
    the training form for a prompt's many. Shapes alone decide, and every rank of the cube holds
    the same ones, so all choose alike."""
    return rows * (q * n_in + n_out) < n_in * n_out
