"""behemoth.planner.moe_bytes: what a mixture-of-experts layer keeps for its backward, against
autograd's saved tensors of the layer as expert parallelism runs it (the grouped GEMMs' path and
the loop's) and as one data rank runs it serially; and the footprint's use of it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import behemoth as bh
from behemoth.models.moe import MoEFeedForward
from behemoth.planner.footprint import ACTIVATION_BYTES, block_activation_bytes
from behemoth.planner.moe_bytes import expert_elementwise_bytes, expert_saved_bytes
from behemoth.planner.workload import workload_for

sys.path.insert(0, str(Path(__file__).parent))
from test_expert_dispatch import OneRankMesh  # noqa: E402

H, I, E, K, T = 256, 192, 8, 2, 2048


def _saved_activations(layer: MoEFeedForward, x: torch.Tensor) -> int:
    """Bytes of the distinct storages ``layer``'s forward saves under bf16 autocast, less its
    parameters and their 16-bit copies (the weights' copies are ``block_activation_bytes``'
    other term)."""
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autocast("cpu", dtype=torch.bfloat16), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x.clone().requires_grad_())
    copies = 2 * sum(p.numel() for p in layer.parameters())
    return sum(seen.values()) - copies


def _layer() -> MoEFeedForward:
    torch.manual_seed(0)
    layer = MoEFeedForward(H, I, E, K, aux_loss_coef=0.01)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.05)
    return layer


def _workload():
    from behemoth.models import LlamaConfig

    shape = dict(num_layers=1, num_heads=4, num_kv_heads=2, hidden=H, ffn_hidden=I, expert_ffn_hidden=I)
    cfg = LlamaConfig(vocab_size=512, seq_len=T, num_experts=E, experts_top_k=K, **shape)
    return workload_for(cfg, seq_len=T, global_batch=1)


ROUTED = bh.Plan(dp=2, ep=2, precision="bf16")
"""A layout whose MoE layers take the routed path (ep > 1)."""
SERIAL = bh.Plan(precision="bf16")
"""... and one data rank's (ep = 1), which runs the serial layer outside the local path."""


def _expected(rows: int, local: bool = False, slot: bool = True, plan: bh.Plan = ROUTED) -> float:
    """The planner's bytes for the layer: its input's 16-bit cast (the router's; a dense MLP's
    input cast, which ``ACTIVATION_BYTES`` counts per hidden unit), the SwiGLU's ``8`` per unit of
    ``I k``, and :func:`expert_saved_bytes`; ``rows`` beyond the T k assignments (the grouped
    GEMMs' padding) hold their input row and their ``8 I`` of intermediates. ``slot``: whether
    the rows need a slot index into the experts' layout (not where they arrive in it: one rank,
    no padding)."""
    per_token = (
        2 * H
        + ACTIVATION_BYTES[(True, True)][2] * I * K
        + expert_saved_bytes(plan, _workload(), local=local)
        - (0 if slot or local else 8 * K)
    )
    return T * per_token + rows * (2 * H + 8 * I)


@pytest.mark.parametrize("path", ["loop", "grouped-routed", "grouped-local"])
def test_expert_parallel_layer_saves_what_the_planner_counts(path, monkeypatch):
    """``loop``: the CPU's per-expert GEMMs; ``grouped-routed``: the GPUs' grouped GEMMs on the
    routed path (what a rank of ep > 1 runs; forced here on one rank); ``grouped-local``: the
    grouped GEMMs of a rank holding every expert (parallel/expert/local.py, the GPUs' path at
    ep = 1), counted by the planner's ``local`` bytes."""
    from behemoth.parallel.expert import ExpertParallel, grouped, style
    from behemoth.parallel.expert.grouped import GROUP_ROWS, pad_groups
    from behemoth.parallel.expert.local import num_layout_rows

    if path != "loop":  # torch._grouped_mm (a loop of its own on CPU builds), groups padded
        monkeypatch.setattr(grouped, "_fast_kernel", lambda x: grouped.gemm_dtype(x) == torch.bfloat16)
    if path == "grouped-routed":
        monkeypatch.setattr(style, "local_ready", lambda *args: False)
    layer = _layer()
    x = torch.randn(1, T, H, generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # routed as the forward below routes them
        counts = torch.bincount(layer.route_tokens(x).experts_TK.reshape(-1), minlength=E).tolist()
    padding = {
        "loop": 0,
        "grouped-routed": sum(pad_groups(counts, GROUP_ROWS)[0]) - T * K,
        "grouped-local": num_layout_rows(T * K, E) - T * K,
    }[path]
    local = path == "grouped-local"
    ExpertParallel().apply(layer, OneRankMesh())
    got = _saved_activations(layer, x)
    # within 0.25%: the padding rows' index tensor and the router loss's scalars are left out; rows
    # arriving in the experts' layout already (one rank, no padding) need no slot index
    want = _expected(padding, local, slot=padding > 0)
    assert got == pytest.approx(want, rel=2.5e-3), (got, want)
    # without the routing's, dispatch's and combine's tensors the count is a third short
    assert got - T * expert_saved_bytes(ROUTED, _workload(), local=local) < 0.7 * got


def test_the_local_path_is_the_planners_at_ep_1_in_16_bit():
    w = _workload()
    one, two = bh.Plan(precision="bf16"), bh.Plan(dp=2, ep=2, precision="bf16")
    assert expert_saved_bytes(one, w) == expert_saved_bytes(one, w, local=True)
    assert expert_saved_bytes(two, w) == expert_saved_bytes(two, w, local=False)
    # the routed path keeps three index tensors beside the gathered weights (28 k), the local path
    # one slot per assignment (8 k); the serial layer (ep = 1 off the local path) also keeps the
    # fp32 weighted product (4 h k), which the routed path's one-node weighted sum does not
    assert expert_saved_bytes(two, w) - expert_saved_bytes(one, w) == 20 * K
    assert expert_saved_bytes(one, w, local=False) - expert_saved_bytes(two, w) == 4 * H * K
    assert expert_saved_bytes(bh.Plan(), w) == expert_saved_bytes(bh.Plan(), w, local=False)  # fp32 GEMMs: routed


def test_serial_layer_saves_what_the_planner_counts():
    layer = _layer()
    x = torch.randn(1, T, H, generator=torch.Generator().manual_seed(1))
    got = _saved_activations(layer, x)
    want = _expected(0, plan=SERIAL)
    assert got == pytest.approx(want, rel=5e-3), (got, want)


def test_experts_keep_a_tensor_parallel_ranks_share_of_the_tokens():
    """Under 1D tensor parallelism the attention's saved set splits over tp, and so does the
    experts' (their SwiGLU over ``I k`` and :func:`expert_saved_bytes`): each tp rank routes and
    runs its own share of the micro-batch's tokens (parallel/expert/tokens.py)."""
    w = workload_for("mixtral-4b", seq_len=2048, global_batch=8)
    s, mbs, t = w.shape, 2, 2 * 2048
    a_rep, a_h, a_f = ACTIVATION_BYTES[(True, True)]
    one = bh.Plan(zero=1, precision="bf16", param_dtype="bf16").resolve(1)
    two = bh.Plan(tp=2, zero=1, precision="bf16", param_dtype="bf16").resolve(2)
    experts = t * (a_f * s.ffn_hidden * K + expert_saved_bytes(one, w))
    assert block_activation_bytes(one, w, mbs)[0] == pytest.approx(t * (a_rep + a_h) * s.hidden + experts)
    assert block_activation_bytes(two, w, mbs)[0] == pytest.approx(t * (a_rep + a_h / 2) * s.hidden + experts / 2)


def test_expert_bytes_grow_with_the_experts_a_token_visits():
    w = _workload()
    assert expert_saved_bytes(bh.Plan(), workload_for("llama-tiny", seq_len=64, global_batch=2)) == 0.0
    assert expert_elementwise_bytes(workload_for("llama-tiny", seq_len=64, global_batch=2)) == (0.0, 0.0)
    # fp32 GEMMs keep 4-byte rows: 12 h k beside the 16-bit GEMMs' 8 h k
    routed = expert_saved_bytes(bh.Plan(precision="bf16"), w, local=False)
    assert expert_saved_bytes(bh.Plan(), w) - routed == 4 * H * K
    f, b = expert_elementwise_bytes(w)
    assert f > 30 * H * K and b > 50 * H * K
