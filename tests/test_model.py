"""model.py against independent references: transformers' afmoe, brute-force masks, a per-expert loop."""

import copy
import math
import warnings
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch.utils._python_dispatch import TorchDispatchMode

import model as model_module
import parallel
from checkpoint import hf_config, load_hf_into, to_hf_state_dict
from model import PRESETS, GroupedExperts, ModelConfig, RMSNorm, Transformer, make_mask, meta_model


def small_cfg(**kw):
    base = dict(vocab_size=256, dim=64, n_layers=4, n_dense_layers=1, dense_hidden=96, n_heads=4, n_kv_heads=2,
                head_dim=16, window=8, max_seq_len=64, n_experts=16, n_shared_experts=1, top_k=4,
                route_scale=2.448, expert_hidden=32, init_std=0.05, aux_loss_coef=0.0, z_loss_coef=0.0)
    base.update(kw)
    return ModelConfig(**base)


def randomise_(model, generator, scale=0.1):
    """Random values for every parameter and buffer (transformers' init zeroes the router and the bias)."""
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if t.dtype.is_floating_point and "inv_freq" not in name:
                t.copy_(torch.randn(t.shape, generator=generator) * scale + (1.0 if "norm" in name else 0.0))


def hf_model(cfg):
    transformers = pytest.importorskip("transformers")  # a requirement: CI installs it, so this never skips there
    hf_cfg = transformers.AfmoeConfig(**{k: v for k, v in cfg.to_hf().items() if k not in ("model_type",
                                                                                            "architectures")})
    hf_cfg._attn_implementation = "eager"
    return transformers.AfmoeForCausalLM(hf_cfg).eval()


@pytest.mark.filterwarnings("ignore:torch.distributed is")  # DCP's single-process load (load_hf_into)
@pytest.mark.parametrize("kw", [dict(), dict(n_shared_experts=2, n_kv_heads=4, n_dense_layers=2),
                                dict(mup=False, n_layers=5, top_k=2)])
def test_logits_match_transformers_from_hf(kw, tmp_path):
    cfg = small_cfg(**kw)
    g = torch.Generator().manual_seed(0)
    hf = hf_model(cfg)
    randomise_(hf, g)
    hf.config.to_json_file(tmp_path / "config.json")  # a folder in the in-memory layout: experts stacked
    save_file(hf.state_dict(), str(tmp_path / "model.safetensors"))
    ours = Transformer(hf_config(str(tmp_path))).eval()
    assert replace(ours.cfg, aux_loss_coef=0.0, z_loss_coef=0.0) == cfg  # training-only knobs are not in HF
    load_hf_into(ours, str(tmp_path))
    tokens = torch.randint(0, cfg.vocab_size, (2, 40), generator=g)  # 40 > window 8: the window matters
    with torch.no_grad():
        diff = (ours(tokens) - hf(tokens).logits).abs().max().item()
    assert diff <= 1e-4


def test_logits_match_transformers_to_hf():
    cfg = small_cfg()
    g = torch.Generator().manual_seed(1)
    ours = Transformer(cfg).eval()
    randomise_(ours, g)
    hf = hf_model(cfg)
    hf.load_state_dict(to_hf_state_dict(ours.state_dict()), strict=True)
    tokens = torch.randint(0, cfg.vocab_size, (2, 33), generator=g)
    with torch.no_grad():
        assert (ours(tokens) - hf(tokens).logits).abs().max().item() <= 1e-4


def test_compiled_rms_norm_matches_eager():
    """The hand-written RMSNorm inside torch.compile (aot_eager) gives eager's output and gradients. torch 2.11 got
    the gradients wrong when the autograd function's output was an in-place result or a no-op cast."""
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(16, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(16, generator=g))
    x, dy = torch.randn(4, 8, 16, generator=g), torch.randn(4, 8, 16, generator=g)
    results = []
    for forward in (norm, torch.compile(norm, backend="aot_eager")):
        norm.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        y = forward(xi)
        y.backward(dy)
        results.append((y, xi.grad, norm.weight.grad))
    for ours, ref in zip(*results):
        assert torch.allclose(ours, ref, atol=1e-6, rtol=1e-6)


def test_config_round_trip():
    for cfg in PRESETS.values():
        assert ModelConfig.from_hf(cfg.to_hf()) == cfg


@pytest.mark.parametrize("shape", [(3, 7, 64), (2, 5, 4, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_autograd_of_its_definition(shape, dtype):
    """The hand-written backward against autograd through the definition (fp32, then cast back), with an upstream
    gradient that is not contiguous (as attention's transposes give the q/k norms)."""
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(shape[-1], 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(shape[-1], generator=g))
    x = torch.randn(*shape, generator=g).to(dtype)
    dy = torch.randn(*shape[:-2], shape[-1], shape[-2], generator=g).to(dtype).transpose(-1, -2)

    def definition(x):
        x32 = x.float()
        return (norm.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + norm.eps))).to(x.dtype)

    results = []
    for forward in (norm, definition):
        norm.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        y = forward(xi)
        y.backward(dy)
        results.append((y, xi.grad, norm.weight.grad))
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for ours, ref in zip(*results):
        assert ours.dtype == ref.dtype
        assert torch.allclose(ours.float(), ref.float(), atol=tol, rtol=tol)


# --- the output head fused with the cross-entropy

@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("ignore", [False, True])
@pytest.mark.parametrize("chunk_rows, grad_chunks", [(7, 2), (7, 8), (40, 8)])
def test_fused_head_loss_matches_linear_then_cross_entropy(autocast, ignore, chunk_rows, grad_chunks, monkeypatch):
    """model.head_loss against F.linear + F.cross_entropy in fp32: the loss, both gradients (with an upstream
    gradient that is not 1), ignored targets, under bf16 autocast, in chunks of 7 rows (the last one partial) and in
    one, the bf16 gradients matmul'd every 2 chunks (14 rows, the last group partial) or once; what it keeps for
    backward is the two gradients, nothing of size [N, V]. Without grad it gives the loss."""
    g = torch.Generator().manual_seed(0)
    model = Transformer(small_cfg(vocab_size=384))
    N, D, V = 40, model.cfg.dim, model.cfg.vocab_size
    monkeypatch.setitem(model_module.HEAD_CHUNK_BYTES, "cpu", chunk_rows * V * 4)
    monkeypatch.setattr(model_module, "HEAD_GRAD_CHUNKS", grad_chunks)
    assert model_module.head_chunks(N, V, torch.device("cpu")) == (chunk_rows, min(N, chunk_rows * grad_chunks))
    with torch.no_grad():
        model.head.weight.copy_(torch.randn(V, D, generator=g) * 0.3)
    h_BTD = torch.randn(2, N // 2, D, generator=g)
    targets_BT = torch.randint(0, V, (2, N // 2), generator=g)
    if ignore:
        targets_BT[:, ::3] = -100
    results, saved = [], {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    for fused in (True, False):
        model.zero_grad(set_to_none=True)
        h = h_BTD.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast and fused):
            with torch.autograd.graph.saved_tensors_hooks(pack if fused else (lambda t: t), lambda t: t):
                loss = (model.head_loss(h, targets_BT)[0] if fused else
                        F.cross_entropy(model.head(h).flatten(0, 1).float(), targets_BT.flatten()))
            with torch.no_grad():
                no_grad_loss = model.head_loss(h, targets_BT)[0]
        (2.5 * loss).backward()
        results.append((loss, no_grad_loss, h.grad, model.head.weight.grad))
    tol = 2e-2 if autocast else 1e-5
    for ours, ref in zip(*results):
        assert ours.dtype == ref.dtype
        assert (ours - ref).abs().max() <= tol * ref.abs().max()
    assert sum(saved.values()) <= h_BTD.nbytes + model.head.weight.nbytes + 64  # dh, dweight and a count


@pytest.mark.parametrize("autocast", [False, True])
def test_fused_head_loss_shifts_rows_whose_exponentials_overflow_or_underflow(autocast, monkeypatch):
    """Rows whose logits are all near +150 (exp overflows) or all near -150 (exp underflows to zero) leave
    model.UNSHIFTED_SUM_RANGE, and their chunk is computed again with each row's max subtracted: the loss and both
    gradients still match F.cross_entropy (under the same autocast: bf16 logits near 150 are only good to 0.5), in
    an ordinary chunk before any such row (unshifted), chunks that hold them, and the chunks after (shifted); the
    bf16 gradients are matmul'd every 2 chunks."""
    g = torch.Generator().manual_seed(2)
    model = Transformer(small_cfg(vocab_size=256))
    N, D, V = 24, model.cfg.dim, model.cfg.vocab_size
    monkeypatch.setitem(model_module.HEAD_CHUNK_BYTES, "cpu", 4 * V * 4)  # chunks of 4 rows
    monkeypatch.setattr(model_module, "HEAD_GRAD_CHUNKS", 2)
    with torch.no_grad():
        model.head.weight.copy_(torch.randn(V, D, generator=g) * 0.3)
        model.head.weight[:, 0] = 1.0  # h[:, 0] moves all of a row's logits together
    h_ND = torch.randn(N, D, generator=g)
    h_ND[:, 0] = torch.tensor([0.0, 0.0, 0.0, 0.0, 150.0, -150.0, 0.0, 150.0] * 3)
    targets_BT = torch.randint(0, V, (1, N), generator=g)
    results = []
    for fused in (True, False):
        model.zero_grad(set_to_none=True)
        h = h_ND.clone().unsqueeze(0).requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = (model.head_loss(h, targets_BT)[0] if fused else
                    F.cross_entropy(model.head(h).flatten(0, 1), targets_BT.flatten()))
        (2.5 * loss).backward()
        results.append((loss, h.grad, model.head.weight.grad))
    tol = 2e-2 if autocast else 1e-5
    for ours, ref in zip(*results):
        assert torch.isfinite(ours).all()
        assert (ours - ref).abs().max() <= tol * ref.abs().max()


def test_compiled_lse_and_grad_matches_eager():
    """lse_and_grad as the fused head loss runs it on CUDA, compiled (here by inductor on the CPU), against its eager
    self: the log-sum-exp, and the bf16 gradient written into its rows of a larger buffer and nowhere else, for two
    chunk lengths, and the log-sum-exp alone."""
    compiled = torch.compile(model_module.lse_and_grad)
    g = torch.Generator().manual_seed(4)
    for C in (6, 4):
        logits_CV = (torch.randn(C, 300, generator=g) * 5).bfloat16()
        t_C1 = torch.randint(0, 300, (C, 1), generator=g)
        buffers = [torch.full((10, 300), 7.0, dtype=torch.bfloat16) for _ in range(2)]
        lse = [fn(logits_CV, t_C1, buf[2:2 + C]) for fn, buf in zip((compiled, model_module.lse_and_grad), buffers)]
        assert torch.allclose(lse[0], lse[1], rtol=1e-6, atol=1e-6)
        assert torch.equal(buffers[0], buffers[1]) and (buffers[0][:2] == 7).all() and (buffers[0][2 + C:] == 7).all()
        assert torch.allclose(compiled(logits_CV, t_C1), lse[1], rtol=1e-6, atol=1e-6)
    # and both against the definition: softmax - onehot, log-sum-exp
    x_CV = logits_CV.float()
    want = torch.softmax(x_CV, -1) - F.one_hot(t_C1.squeeze(1), 300)
    assert (buffers[0][2:2 + C].float() - want).abs().max() <= 2 ** -8 * want.abs().max()
    assert torch.allclose(lse[1], torch.logsumexp(x_CV, -1, keepdim=True), rtol=1e-6)


@pytest.mark.parametrize("setting, cpu_exact", [("cuda tf32", True), ("cpu bf16", False), ("legacy high", False)])
def test_fused_head_loss_under_reduced_fp32_matmul_precision(setting, cpu_exact):
    """Users lower the fp32 matmul precision per backend or through torch.set_float32_matmul_precision (torch's
    global getter then raises once both kinds of setting were used). The head loss reads its own device's setting:
    it still runs, takes the rounding-safe path where CPU matmuls may round to TF32 or bf16, and matches
    F.cross_entropy computed under the same setting. Every setting is restored afterwards."""
    backends, cuda, cpu = torch.backends, torch.backends.cuda.matmul, torch.backends.mkldnn.matmul
    legacy, saved = torch.get_float32_matmul_precision(), (backends.fp32_precision, cuda.fp32_precision,
                                                           cpu.fp32_precision)
    try:
        if setting == "cuda tf32":
            cuda.fp32_precision = "tf32"
        elif setting == "cpu bf16":
            cpu.fp32_precision = "bf16"
        else:
            torch.set_float32_matmul_precision("high")
        assert model_module.fp32_matmul_is_exact(torch.device("cpu")) == cpu_exact
        g = torch.Generator().manual_seed(3)
        h = torch.randn(30, 16, generator=g, requires_grad=True)
        weight = (torch.randn(200, 16, generator=g) * 0.3).requires_grad_()
        targets = torch.randint(0, 200, (30,), generator=g)
        loss_N, _, dh, dweight = model_module.head_cross_entropy(h.detach(), weight.detach(), targets, True)
        ref_N = F.cross_entropy(h @ weight.t(), targets, reduction="none")
        ref_dh, ref_dweight = torch.autograd.grad(ref_N.sum(), (h, weight))
    finally:
        torch.set_float32_matmul_precision(legacy)
        backends.fp32_precision, cuda.fp32_precision, cpu.fp32_precision = saved
    assert torch.get_float32_matmul_precision() == legacy
    tol = 1e-5 if cpu_exact else 2e-2
    for ours, theirs in ((loss_N, ref_N.detach()), (dh, ref_dh), (dweight, ref_dweight)):
        assert (ours - theirs).abs().max() <= tol * theirs.abs().max()


def test_model_loss_is_the_cross_entropy_of_its_logits():
    g = torch.Generator().manual_seed(1)
    model = Transformer(small_cfg())
    randomise_(model, g)
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 17), generator=g)
    grads = []
    for fused in (True, False):
        model.zero_grad(set_to_none=True)
        loss = (model(tokens[:, :-1], targets_BT=tokens[:, 1:]) if fused else
                F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()))
        loss.backward()
        grads.append((loss, *[p.grad for p in model.parameters()]))
    for ours, ref in zip(*grads):
        assert torch.allclose(ours, ref, atol=1e-6, rtol=1e-5)
    targets = tokens[:, 1:].clone()
    targets[0, :5] = -100  # each sequence's loss is the mean over its own valid targets
    _, stats = model(tokens[:, :-1], targets_BT=targets, return_stats=True)
    per_token = F.cross_entropy(model(tokens[:, :-1]).transpose(1, 2), targets, reduction="none")
    assert not stats.loss_B.requires_grad
    assert torch.allclose(stats.loss_B, per_token.sum(1) / (targets != -100).sum(1), atol=1e-6, rtol=1e-5)


# --- experts: grouped GEMM against the per-expert loop

@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_grouped_mm_matches_loop(dtype, tol):
    g = torch.Generator().manual_seed(0)
    experts = GroupedExperts(8, 32, 16)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(8, 32, 32, generator=g) * 0.2)
        experts.down_proj.copy_(torch.randn(8, 32, 16, generator=g) * 0.2)
    counts = torch.tensor([5, 0, 3, 9, 0, 1, 12, 2])  # empty experts included
    x = torch.randn(int(counts.sum()), 32, generator=g)
    dy = torch.randn(int(counts.sum()), 32, generator=g)
    scale = torch.rand(int(counts.sum()), generator=g)  # the router's gates, one per row
    results = []
    for impl in ("grouped", "loop"):
        experts.impl = impl
        xi, si = x.to(dtype).requires_grad_(), scale.clone().requires_grad_()
        y = experts(xi, counts, si)
        y.backward(dy.to(dtype))
        results.append((y.float(), xi.grad.float(), si.grad, experts.gate_up_proj.grad.clone(),
                        experts.down_proj.grad.clone()))
        experts.zero_grad(set_to_none=True)
    for a, b in zip(*results):
        assert torch.allclose(a, b, atol=tol, rtol=tol)


# --- attention masks against a brute-force loop

def brute_force_mask(T, window, doc_ids_BT):
    B = doc_ids_BT.shape[0]
    keep = torch.zeros(B, 1, T, T, dtype=torch.bool)
    for b in range(B):
        for q in range(T):
            for k in range(T):
                keep[b, 0, q, k] = (k <= q and (window is None or k > q - window)
                                    and doc_ids_BT[b, q] == doc_ids_BT[b, k])
    return keep


@pytest.mark.parametrize("window", [None, 1, 5])
def test_mask_matches_brute_force(window):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 4, (3, 20), generator=g)
    doc_ids = torch.cumsum(tokens == 0, dim=1) - (tokens == 0).long()  # EOT (0) belongs to the document it ends
    assert torch.equal(make_mask(20, window, doc_ids, torch.device("cpu")), brute_force_mask(20, window, doc_ids))


@pytest.mark.parametrize("window", [None, 6])
def test_flex_block_mask_matches_sdpa_path(window):
    """The CUDA path (flex attention + BlockMask) and the CPU path (SDPA + boolean mask) compute the same thing.
    Flex runs here uncompiled, forward only (it has no CPU backward)."""
    from torch.nn.attention.flex_attention import flex_attention
    g = torch.Generator().manual_seed(0)
    B, H, G, T, Dh = 2, 4, 2, 256, 16
    q, k, v = (torch.randn(B, n, T, Dh, generator=g) for n in (H, G, G))
    doc_ids = torch.randint(0, 5, (B, T), generator=g).sort(-1).values
    cpu = torch.device("cpu")
    block_mask = make_mask(T, window, doc_ids, cpu, flex=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "called without torch.compile": expected on CPU
        out_flex = flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)
    out_sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=make_mask(T, window, doc_ids, cpu), enable_gqa=True)
    assert (out_flex - out_sdpa).abs().max() < 1e-5


def test_document_mask_isolates_documents():
    """Changing one document's tokens must not change another document's logits."""
    cfg = small_cfg()
    model = Transformer(cfg).eval()
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, cfg.vocab_size, (1, 24), generator=g)
    doc_ids = torch.tensor([[0] * 10 + [1] * 14])
    changed = tokens.clone()
    changed[0, :10] = torch.randint(1, cfg.vocab_size, (10,), generator=g)
    with torch.no_grad():
        a, b = model(tokens, doc_ids_BT=doc_ids), model(changed, doc_ids_BT=doc_ids)
    assert torch.allclose(a[0, 10:], b[0, 10:], atol=1e-5)
    assert not torch.allclose(a[0, :10], b[0, :10], atol=1e-3)


# --- router invariants

def test_router_invariants():
    cfg = small_cfg()
    moe = Transformer(cfg).moe_layers()[0]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, cfg.dim, generator=g)
    experts, gates, scores, _ = moe.route(x)
    assert all(len(set(row.tolist())) == cfg.top_k for row in experts)
    assert torch.allclose(gates.sum(-1), torch.full((50,), cfg.route_scale))
    # A large bias on expert 3 puts it in every token's top-k, but gate values still come from unbiased scores.
    with torch.no_grad():
        moe.expert_bias[3] = 10.0
    experts_b, gates_b, _, _ = moe.route(x)
    assert (experts_b == 3).any(-1).all()
    chosen = scores.gather(-1, experts_b)
    assert torch.allclose(gates_b, chosen / chosen.sum(-1, keepdim=True) * cfg.route_scale)
    assert not moe.expert_bias.requires_grad and "ffn.expert_bias" in "".join(Transformer(cfg).state_dict())


def test_counts_and_expert_bias_untouched_by_gradients():
    cfg = small_cfg(aux_loss_coef=1e-2, z_loss_coef=1e-3)
    model = Transformer(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    loss, stats = model(tokens, targets_BT=tokens, return_stats=True)
    (loss + stats.balance_loss).backward()
    assert stats.counts_LE.sum(-1).tolist() == [2 * 16 * cfg.top_k] * len(model.moe_layers())
    for moe in model.moe_layers():
        assert moe.expert_bias.grad is None and moe.router.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("ac", ["full", "selective"])
def test_router_stats_count_each_token_once_under_activation_checkpointing(ac):
    """Activation checkpointing re-runs every block's forward during backward: the stats are the first run's, the
    same counts and losses as without it, and the gradients match."""
    cfg = small_cfg(aux_loss_coef=1e-2, z_loss_coef=1e-3)
    plain = Transformer(cfg)
    checkpointed = copy.deepcopy(plain)
    parallel.apply_ac(checkpointed, ac)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    runs = []
    for model in (plain, checkpointed):
        loss, stats = model(tokens, targets_BT=tokens, return_stats=True)
        (loss + stats.balance_loss).backward()
        runs.append([stats.counts_LE, stats.aux_loss, stats.z_loss, model.layers["1"].ffn.router.weight.grad])
    assert runs[0][0].sum().item() == 2 * 16 * cfg.top_k * len(plain.moe_layers())
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b)


def reference_moe(moe, x_BTD):
    """The MoE block token by token, written out: each token through its k chosen experts and the shared expert,
    and the balance losses by their definitions with explicit loops over sequences."""
    B, T, D = x_BTD.shape
    E, K = moe.cfg.n_experts, moe.cfg.top_k
    x_ND = x_BTD.reshape(-1, D)
    logits_NE = x_ND @ moe.router.weight.t()
    scores_NE = torch.sigmoid(logits_NE)
    experts_NK = torch.topk(scores_NE + moe.expert_bias, K, dim=-1).indices
    rows = []
    for n in range(x_ND.shape[0]):
        chosen = scores_NE[n, experts_NK[n]]
        gates = chosen / chosen.sum() * moe.cfg.route_scale
        y = moe.shared(x_ND[n])
        for k in range(K):
            e = experts_NK[n, k]
            gate, up = (moe.experts.gate_up_proj[e] @ x_ND[n]).chunk(2)
            y = y + gates[k] * (moe.experts.down_proj[e] @ (F.silu(gate) * up))
        rows.append(y)
    aux = 0.0
    for b in range(B):
        seq = slice(b * T, (b + 1) * T)
        f = torch.stack([(experts_NK[seq] == e).any(-1).float().sum() for e in range(E)]) * E / (K * T)
        p = (scores_NE[seq] / scores_NE[seq].sum(-1, keepdim=True)).mean(0)
        aux = aux + (f * p).sum() / B
    z = torch.logsumexp(logits_NE, -1).pow(2).mean()
    return torch.stack(rows).view(B, T, D), (None, moe.cfg.aux_loss_coef * aux, moe.cfg.z_loss_coef * z)


def test_moe_forward_and_gradients_match_token_by_token_reference():
    cfg = small_cfg(aux_loss_coef=1e-2, z_loss_coef=1e-3)
    moe = Transformer(cfg).moe_layers()[0]
    g = torch.Generator().manual_seed(0)
    randomise_(moe, g, scale=0.2)
    x = torch.randn(3, 10, cfg.dim, generator=g)
    dy = torch.randn(3, 10, cfg.dim, generator=g)
    results = []
    for forward in (moe, lambda x: reference_moe(moe, x)):
        moe.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        y, (_, aux, z) = forward(xi)
        ((y * dy).sum() + aux + z).backward()
        results.append([y, aux, z, xi.grad] + [p.grad.clone() for p in moe.parameters()])
    for ours, ref in zip(*results):
        assert torch.allclose(ours, ref, atol=1e-5, rtol=1e-4), (ours - ref).abs().max()


# --- no host reads on the training path

# Ops that read a device value back to the host, or make a shape that depends on one: each stalls the GPU's queue.
HOST_READS = ("aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten.unique", "aten._unique")


class OpRecorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if str(func).startswith(HOST_READS) or (str(func) == "aten.repeat_interleave.Tensor"
                                                 and kwargs.get("output_size") is None):
            self.reads.append(str(func))
        return func(*args, **kwargs)


def test_training_forward_and_backward_never_read_the_device():
    """The training path as it runs on CUDA (bf16 autocast, grouped GEMM, the fused head's rounding
    path, balance losses, document masks) asks for no host read in forward or backward: every op is recorded on the
    CPU. It catches one, the exact fp32 head's check of its exponential sums; a read inside a CUDA kernel's own
    launcher shows only on a GPU (tests/test_cuda.py runs the MoE layer under torch's sync debug mode)."""
    model = Transformer(small_cfg(aux_loss_coef=1e-2, z_loss_coef=1e-3))
    for moe in model.moe_layers():
        moe.experts.impl = "grouped"
    g = torch.Generator().manual_seed(0)
    tokens_BT, targets_BT = torch.randint(0, 256, (2, 32), generator=g), torch.randint(0, 256, (2, 32), generator=g)
    doc_ids_BT = torch.arange(32).repeat(2, 1) // 10
    for autocast, reads in ((True, []), (False, ["aten._local_scalar_dense.default"])):
        with OpRecorder() as recorder, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss, stats = model(tokens_BT, targets_BT=targets_BT, doc_ids_BT=doc_ids_BT, return_stats=True)
            (loss + stats.balance_loss).backward()
        assert recorder.reads == reads


# --- construction and counting

def test_meta_construction_then_init_matches_statistics():
    cfg = small_cfg()
    with torch.device("meta"):
        model = Transformer(cfg)
    assert all(p.device.type == "meta" for p in model.parameters())
    model.to_empty(device="cpu")
    model.init_weights()
    w = model.layers["1"].ffn.experts.gate_up_proj
    assert w.abs().max() <= 3 * cfg.init_std + 1e-7 and abs(w.std().item() - cfg.init_std) < 0.2 * cfg.init_std
    assert torch.allclose(model.layers["0"].attn_post_norm.weight, torch.full((cfg.dim,), 1 / math.sqrt(4)))
    assert torch.equal(model.layers["0"].attn_norm.weight, torch.ones(cfg.dim))
    assert torch.equal(model.layers["1"].ffn.expert_bias, torch.zeros(cfg.n_experts))


def test_preset_counts_match_spec():
    large = meta_model(PRESETS["large"])
    n = large.num_params()
    assert abs(n["total"] / 398.7e9 - 1) < 0.005 and abs(n["active"] / 13.4e9 - 1) < 0.03
    assert abs(large.flops_per_token(8192) / 99.5e9 - 1) < 0.01
    mini, nano = meta_model(PRESETS["mini"]).num_params(), meta_model(PRESETS["nano"]).num_params()
    assert abs(mini["total"] / 26e9 - 1) < 0.05 and abs(mini["active"] / 3e9 - 1) < 0.2
    assert abs(nano["total"] / 6e9 - 1) < 0.05 and abs(nano["active"] / 1e9 - 1) < 0.1


def test_tiny_preset_keeps_the_trinity_structure_and_starts_at_ln_vocab():
    cfg = PRESETS["tiny"]
    assert (cfg.n_experts, cfg.top_k, cfg.n_shared_experts) == (256, 4, 1) and cfg.n_dense_layers >= 1
    assert [cfg.is_global(i) for i in range(4)] == [False, False, False, True]
    torch.manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (2, 65))
    with torch.no_grad():
        loss = Transformer(cfg)(tokens[:, :-1], targets_BT=tokens[:, 1:])
    assert abs(loss.item() - math.log(cfg.vocab_size)) < 0.3


def test_initial_loss_near_ln_vocab_and_overfits_one_batch():
    torch.manual_seed(0)
    cfg = small_cfg(vocab_size=512, aux_loss_coef=1e-4, z_loss_coef=1e-6)
    model = Transformer(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (4, 32))
    loss = model(tokens[:, :-1], targets_BT=tokens[:, 1:])
    assert abs(loss.item() - math.log(cfg.vocab_size)) < 0.5
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(60):  # the loss is below 0.3 by step 30 and about 0.03 at step 60
        loss, stats = model(tokens[:, :-1], targets_BT=tokens[:, 1:], return_stats=True)
        loss = loss + stats.balance_loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_experts_match_eager(dtype):
    """The grouped GEMM traces under torch.compile in bf16 and runs eagerly (a graph break) in fp32 on CPU."""
    g = torch.Generator().manual_seed(0)
    experts = GroupedExperts(8, 32, 16).to(dtype)
    with torch.no_grad():
        for w in (experts.gate_up_proj, experts.down_proj):
            w.copy_(torch.randn(w.shape, generator=g) * 0.2)
    counts = torch.tensor([2, 3, 0, 5, 1, 4, 3, 2])
    x = torch.randn(20, 32, generator=g).to(dtype)
    scale = torch.rand(20, generator=g)
    compiled = torch.compile(experts, backend="aot_eager")
    assert torch.equal(compiled(x, counts, scale), experts(x, counts, scale))


def test_count_ids_matches_bincount():
    g = torch.Generator().manual_seed(0)
    for n in (1, 7, 256):
        ids = torch.randint(0, n, (1000,), generator=g)
        assert torch.equal(model_module.count_ids(ids, n), torch.bincount(ids, minlength=n))
    empty = torch.tensor([], dtype=torch.int64)
    assert torch.equal(model_module.count_ids(empty, 3), torch.zeros(3, dtype=torch.int64))
