"""The CUDA paths against the CPU ones: flex attention with block masks, bf16 grouped GEMM, the fused head loss under
bf16 autocast, fused AdamW, and a few training steps. Every test here skips without a GPU (CI has none); `.ci/gpu`
runs them on a machine that has one.

    python -m pytest tests/test_cuda.py -q"""

import pytest
import torch
import torch.nn.functional as F

import model as model_module
import parallel
import train
from model import ModelConfig, Transformer, expert_ffn

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU; CI and the CPU machine have none")

CFG = ModelConfig(vocab_size=512, dim=64, n_layers=4, n_dense_layers=1, dense_hidden=128, n_heads=4, n_kv_heads=2,
                  head_dim=16, window=32, max_seq_len=256, n_experts=16, n_shared_experts=1, top_k=4,
                  expert_hidden=32, init_std=0.05)
CUDA, CPU = torch.device("cuda"), torch.device("cpu")


@pytest.fixture(autouse=True)
def exact_fp32_matmuls():
    """TF32 would make fp32 CUDA matmuls differ from CPU's by ~1e-3; compare at full fp32."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


def batch(T=256, B=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens_BT = torch.randint(1, CFG.vocab_size, (B, T + 1), generator=g)
    tokens_BT[:, ::50] = 0  # document boundaries, so the intra-document masks matter
    doc_ids_BT = torch.cumsum(tokens_BT[:, :-1] == 0, dim=1)
    return tokens_BT[:, :-1], tokens_BT[:, 1:], doc_ids_BT


def loss_and_grads(model, tokens_BT, targets_BT, doc_ids_BT, autocast=False):
    model.zero_grad(set_to_none=True)
    with torch.autocast(CUDA.type, dtype=torch.bfloat16, enabled=autocast):
        loss = model(tokens_BT, targets_BT=targets_BT, doc_ids_BT=doc_ids_BT) + model.balance_loss()
    loss.backward()
    return loss.detach().float().cpu(), {n: p.grad.float().cpu() for n, p in model.named_parameters()}


def relative_error(a, b):
    """||a - b|| / ||b||: bf16 rounds each element by up to 0.4%, and the errors of a few layers add up in norm."""
    return ((a - b).norm() / b.norm().clamp(min=1e-12)).item()


@pytest.mark.parametrize("autocast, loss_tol, min_cosine", [(False, 1e-2, 0.99), (True, 2e-2, 0.95)])
def test_model_on_cuda_matches_cpu(autocast, loss_tol, min_cosine):
    """The same weights and tokens: CUDA (compiled flex attention with a block mask, bf16 grouped GEMM, the fused
    head loss, fp32 or under bf16 autocast) against CPU (SDPA with a boolean mask, fp32): the loss, and the direction
    of every gradient. bf16 tolerances: CUDA's experts always run in bf16, and under autocast a few near-tied router
    choices flip (CPU's own bf16 autocast gives cosines of 0.98-0.999 against fp32 on this model)."""
    torch.manual_seed(0)
    cpu_model = Transformer(CFG)
    cuda_model = Transformer(CFG).to(CUDA)
    cuda_model.load_state_dict(cpu_model.state_dict())
    tokens_BT, targets_BT, doc_ids_BT = batch()
    want_loss, want = loss_and_grads(cpu_model, tokens_BT, targets_BT, doc_ids_BT)
    loss, grads = loss_and_grads(cuda_model, tokens_BT.to(CUDA), targets_BT.to(CUDA), doc_ids_BT.to(CUDA), autocast)
    assert abs(loss - want_loss) <= loss_tol * abs(want_loss)
    for name, g in want.items():
        assert torch.isfinite(grads[name]).all(), name
        assert F.cosine_similarity(grads[name].flatten(), g.flatten(), dim=0) >= min_cosine, name


def test_grouped_mm_bf16_matches_loop_on_cuda():
    g = torch.Generator().manual_seed(0)
    counts_E = torch.tensor([5, 0, 3, 9, 0, 1, 12, 2], device=CUDA)  # empty experts included
    M = int(counts_E.sum())
    gate_up_EHD = (torch.randn(8, 64, 32, generator=g) * 0.2).to(CUDA).requires_grad_()
    down_EDI = (torch.randn(8, 32, 32, generator=g) * 0.2).to(CUDA).requires_grad_()
    x_MD, dy_MD, scale_M = (t.to(CUDA) for t in (torch.randn(M, 32, generator=g), torch.randn(M, 32, generator=g),
                                                 torch.rand(M, generator=g)))
    results = []
    for impl in ("grouped", "loop"):
        x = x_MD.clone().requires_grad_()
        y = expert_ffn(x, counts_E, gate_up_EHD, down_EDI, impl, scale_M)
        y.backward(dy_MD)
        results.append((y.float(), x.grad.float(), gate_up_EHD.grad.clone(), down_EDI.grad.clone()))
        gate_up_EHD.grad = down_EDI.grad = None
    assert results[0][0].dtype == torch.float32  # bf16 inside, the caller's dtype outside
    for a, b in zip(*results):
        assert relative_error(a, b) <= 2e-2


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("chunk_rows", [48, 128])
def test_fused_head_loss_on_cuda(autocast, chunk_rows, monkeypatch):
    """The chunked, in-place exponentials and gradients of the fused head loss against F.cross_entropy, on CUDA, in
    chunks of 48 rows (the last one partial) and in one."""
    monkeypatch.setitem(model_module.HEAD_CHUNK_BYTES, CUDA.type, chunk_rows * CFG.vocab_size * 4)
    g = torch.Generator().manual_seed(0)
    model = Transformer(CFG).to(CUDA)
    h_BTD = torch.randn(2, 64, CFG.dim, generator=g).to(CUDA)
    targets_BT = torch.randint(0, CFG.vocab_size, (2, 64), generator=g).to(CUDA)
    targets_BT[:, ::7] = -100
    results = []
    for fused in (True, False):
        model.zero_grad(set_to_none=True)
        h = h_BTD.clone().requires_grad_()
        with torch.autocast(CUDA.type, dtype=torch.bfloat16, enabled=autocast and fused):
            loss = (model.head_loss(h, targets_BT) if fused else
                    F.cross_entropy(model.head(h).flatten(0, 1).float(), targets_BT.flatten()))
        loss.backward()
        results.append((loss, h.grad, model.head.weight.grad))
    for ours, want in zip(*results):
        assert relative_error(ours.float(), want.float()) <= (2e-2 if autocast else 1e-5)


def test_training_steps_on_cuda_reduce_the_loss():
    """train.train_step as train.py runs it on one GPU: bf16 autocast, fused AdamW, clipping, the expert-bias
    update; ten steps on one batch must lower its loss, and nothing may turn non-finite."""
    tc = train.TrainConfig(global_batch=2, micro_batch=2, seq_len=256, lr=3e-3)
    model = parallel.build_model(CFG, parallel.Layout(1), None, CUDA)
    optimizer = train.build_optimizer(model, tc)
    assert all(group.get("fused") for group in optimizer.param_groups)
    autocast, dtype = train.autocast_for(tc, CUDA)
    assert dtype == torch.bfloat16
    state = {"step": 0, "momentum": torch.zeros(len(model.moe_layers()), CFG.n_experts, device=CUDA), "skipped": 0,
             "bad_steps": 0}
    losses = [train.train_step(model, optimizer, batch(), tc, autocast, state)["lm_loss"] for _ in range(10)]
    assert state["skipped"] == 0
    assert losses[-1] < losses[0] - 0.5, losses


def test_moe_block_is_bitwise_reproducible_on_cuda():
    """Two forward and backward passes of the MoE block on the same input give identical bits: on CUDA the rows are
    added back into their tokens by a gather and a fixed-order sum (MoE.combine "gather"), not by atomics."""
    torch.manual_seed(0)
    moe = Transformer(CFG).to(CUDA).moe_layers()[0]
    assert moe.combine == "auto"
    x_BTD = torch.randn(4, 256, CFG.dim, device=CUDA)
    dy_BTD = torch.randn_like(x_BTD)
    runs = []
    for _ in range(2):
        moe.zero_grad(set_to_none=True)
        x = x_BTD.clone().requires_grad_()
        y = moe(x)
        y.backward(dy_BTD)
        runs.append([y, x.grad] + [p.grad.clone() for p in moe.parameters()])
    for first, second in zip(*runs):
        assert torch.equal(first, second)


def test_moe_layer_dispatch_has_no_host_sync():
    """The routed experts' dispatch (routing, counts, sort, grouped GEMMs, combine) and its backward never wait for
    the GPU: torch's sync debug mode raises on any operation that reads a device value back to the host."""
    moe = Transformer(CFG).to(CUDA).moe_layers()[0]
    x = torch.randn(2, 256, CFG.dim, device=CUDA, requires_grad=True)
    with torch.autocast(CUDA.type, dtype=torch.bfloat16):
        moe(x)  # warm-up: lazy initialisation may sync once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.autocast(CUDA.type, dtype=torch.bfloat16):
            y = moe(x)
        (y.float().square().mean() + moe.aux_loss + moe.z_loss).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
