"""Training setups tried as a user would, beyond single ops and losses (``bench_losses.py``): CTC, packed
sequences, straight-through estimators (Gumbel-softmax, fake quantization, a custom ``autograd.Function``),
reparameterised sampling, sparse and bag embeddings, Hessian-vector products, ``torch.func``, parametrizations,
padding masks, autocast, checkpointing, retained graphs, transposed and 3-D convolutions, sorting and quantiles,
contrastive and entropy terms. Each: all parameter gradients (or the returned gradient) under ``compress(bits=b)``
(``min_numel=0``: every save, these setups being small) and the default ``compress()`` against plain PyTorch's,
same seeds, with how many saves each quantized; an exception is reported by its type and message (a daftrain error
that refuses a setup is a result, not a crash).

    flock /tmp/daftrain-bench.lock .venv/bin/python benchmarks/bench_setups.py
    .venv/bin/python benchmarks/bench_setups.py --cases custom_function ctc --out /tmp/setups.json
"""

from __future__ import annotations

import argparse
import math
import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_json

import daftrain


def cos(a: torch.Tensor, b: torch.Tensor) -> float:
    v = F.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0).item()
    return v if math.isfinite(v) else float("nan")


def ctxed(ctx, fn):  # type: ignore[no-untyped-def]
    """``fn()`` under ``ctx`` (plain PyTorch where it is None)."""
    if ctx is None:
        return fn()
    with ctx:
        return fn()


def weighted(model, forward, weights, seed=None):  # type: ignore[no-untyped-def]
    """A setup whose loss is a fixed weighting of ``forward(model)``'s output, under torch's seed ``seed`` where one
    is given (dropout, power iteration)."""

    def step(m, ctx):  # type: ignore[no-untyped-def]
        if seed is not None:
            torch.manual_seed(seed)
        (ctxed(ctx, lambda: forward(m)) * weights).sum().backward()

    return model, step


def ctc(inside: bool):  # type: ignore[no-untyped-def]
    """CTC over a small model's log-probabilities, the loss computed outside the context or ``inside`` it."""
    m = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 20))
    x = torch.randn(50, 4, 32)
    tgt = torch.randint(1, 20, (4, 12))

    def loss(lp):  # type: ignore[no-untyped-def]
        return F.ctc_loss(lp, tgt, torch.full((4,), 50), torch.full((4,), 12))

    def step(m, ctx):
        if inside:
            ctxed(ctx, lambda: loss(m(x).log_softmax(-1))).backward()
        else:
            loss(ctxed(ctx, lambda: m(x).log_softmax(-1))).backward()

    return m, step


def c_ctc():
    return ctc(inside=False)


def c_ctc_inside():
    return ctc(inside=True)


def c_packed_lstm():
    m = nn.LSTM(16, 32, batch_first=True, num_layers=2)
    x = torch.randn(8, 20, 16)
    lens = torch.tensor([20, 18, 15, 15, 10, 7, 5, 2])

    def step(m, ctx):
        def f():
            p = nn.utils.rnn.pack_padded_sequence(x, lens, batch_first=True)
            out, _ = m(p)
            o, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True)
            return o

        o = ctxed(ctx, f)
        (o * torch.randn_like(o, device="cpu")).sum().backward()

    return m, step


def c_gumbel_hard():
    m = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 10))
    x = torch.randn(64, 32)
    w = torch.randn(64, 10)

    def step(m, ctx):
        torch.manual_seed(5)
        o = ctxed(ctx, lambda: F.gumbel_softmax(m(x), tau=0.5, hard=True))
        (o * w).sum().backward()

    return m, step


def c_rsample():
    m = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 20))
    x = torch.randn(64, 32)

    def step(m, ctx):
        torch.manual_seed(5)

        def f():
            h = m(x)
            mu, ls = h[:, :10], h[:, 10:]
            d = torch.distributions.Normal(mu, ls.exp())
            z = d.rsample()
            return (z**2).sum() + torch.distributions.kl_divergence(d, torch.distributions.Normal(0.0, 1.0)).sum()

        ctxed(ctx, f).backward()

    return m, step


def c_fake_quant():
    m = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    x = torch.randn(64, 32)
    w = torch.randn(64, 10)

    def forward(m):
        h = m[0](x)
        h = torch.fake_quantize_per_tensor_affine(h, 0.05, 0, -128, 127)
        return m[2](m[1](h))

    return weighted(m, forward, w)


def c_embedding_bag():
    m = nn.Sequential()
    m.bag = nn.EmbeddingBag(100, 32, mode="mean")
    m.lin = nn.Linear(32, 4)
    idx = torch.randint(0, 100, (64, 8))
    w = torch.randn(64, 4)

    return weighted(m, lambda m: m.lin(m.bag(idx)), w)


def c_embedding_bag_max():
    m = nn.Sequential()
    m.bag = nn.EmbeddingBag(100, 32, mode="max")
    m.lin = nn.Linear(32, 4)
    idx = torch.randint(0, 100, (64, 8))
    w = torch.randn(64, 4)

    return weighted(m, lambda m: m.lin(torch.tanh(m.bag(idx))), w)


def c_sparse_embedding():
    m = nn.Sequential(nn.Embedding(100, 32, sparse=True), nn.Linear(32, 4))
    idx = torch.randint(0, 100, (64, 8))
    w = torch.randn(64, 8, 4)

    def step(m, ctx):
        (ctxed(ctx, lambda: m(idx)) * w).sum().backward()
        return torch.cat([m[0].weight.grad.to_dense().flatten(), m[1].weight.grad.flatten()])

    return m, step


def c_hvp():
    m = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    x = torch.randn(64, 16)

    def step(m, ctx):
        params = list(m.parameters())
        loss = ctxed(ctx, lambda: m(x).pow(2).mean())
        g = torch.autograd.grad(loss, params, create_graph=True)
        v = [torch.ones_like(p) for p in params]
        hv = torch.autograd.grad(sum((gi * vi).sum() for gi, vi in zip(g, v, strict=True)), params)
        return torch.cat([h.flatten() for h in hv])

    return m, step


def c_func_grad():
    m = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    x = torch.randn(64, 16)

    def step(m, ctx):
        params = dict(m.named_parameters())

        def loss(p):
            return torch.func.functional_call(m, p, (x,)).pow(2).mean()

        g = ctxed(ctx, lambda: torch.func.grad(loss)(params))
        return torch.cat([v.flatten() for v in g.values()])

    return m, step


def c_per_sample_grads():
    m = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    x = torch.randn(8, 16)

    def step(m, ctx):
        params = {k: v.detach() for k, v in m.named_parameters()}

        def loss(p, xi):
            return torch.func.functional_call(m, p, (xi[None],)).pow(2).sum()

        g = ctxed(ctx, lambda: torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, x))
        return torch.cat([v.flatten() for v in g.values()])

    return m, step


def c_weight_norm():
    m = nn.Sequential(nn.utils.parametrizations.weight_norm(nn.Linear(32, 64)), nn.GELU(), nn.Linear(64, 10))
    x = torch.randn(64, 32)
    w = torch.randn(64, 10)

    return weighted(m, lambda m: m(x), w)


def c_spectral_norm():
    m = nn.Sequential(nn.utils.parametrizations.spectral_norm(nn.Linear(32, 64)), nn.LeakyReLU(0.2), nn.Linear(64, 10))
    x = torch.randn(64, 32)
    w = torch.randn(64, 10)

    return weighted(m, lambda m: m(x), w, seed=3)


def c_mha_padding():
    m = nn.MultiheadAttention(32, 4, batch_first=True)
    x = torch.randn(8, 16, 32)
    mask = torch.zeros(8, 16, dtype=torch.bool)
    mask[:, 12:] = True
    w = torch.randn(8, 16, 32)

    return weighted(m, lambda m: m(x, x, x, key_padding_mask=mask)[0], w)


def c_transformer_mask():
    m = nn.TransformerEncoder(
        nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True), 2, enable_nested_tensor=False
    )
    x = torch.randn(8, 16, 32)
    mask = torch.zeros(8, 16, dtype=torch.bool)
    mask[:, 10:] = True
    w = torch.randn(8, 16, 32)

    def step(m, ctx):
        o = ctxed(ctx, lambda: m(x, src_key_padding_mask=mask))
        (o.masked_fill(mask[..., None], 0) * w).sum().backward()

    return m, step


def c_conv_transpose_pixelshuffle():
    m = nn.Sequential(
        nn.ConvTranspose2d(8, 16, 4, 2, 1),
        nn.BatchNorm2d(16),
        nn.SiLU(),
        nn.Conv2d(16, 16, 3, padding=1),
        nn.PixelShuffle(2),
        nn.Upsample(scale_factor=2, mode="bilinear"),
        nn.Conv2d(4, 3, 3, padding=1),
    )
    x = torch.randn(4, 8, 8, 8)
    w = torch.randn(4, 3, 64, 64)

    return weighted(m, lambda m: m(x), w)


def c_conv3d():
    m = nn.Sequential(
        nn.Conv3d(3, 8, 3, padding=1),
        nn.InstanceNorm3d(8, affine=True),
        nn.LeakyReLU(0.1),
        nn.MaxPool3d(2),
        nn.Conv3d(8, 8, 3, padding=1),
        nn.AdaptiveAvgPool3d(1),
        nn.Flatten(),
        nn.Linear(8, 2),
    )
    x = torch.randn(2, 3, 8, 16, 16)
    w = torch.randn(2, 2)

    return weighted(m, lambda m: m(x), w)


def c_sort_topk():
    m = nn.Sequential(nn.Linear(32, 64), nn.GELU())
    x = torch.randn(64, 32)
    w = torch.randn(64, 8)

    def forward(m):
        h = m(x)
        return (
            h.topk(8, -1).values
            + h.sort(-1).values[:, :8]
            + h.median(-1, keepdim=True).values
            + torch.quantile(h, 0.9, dim=-1, keepdim=True)
        )

    return weighted(m, forward, w)


def c_cumprod():
    m = nn.Sequential(nn.Linear(32, 32), nn.Sigmoid())
    x = torch.randn(64, 32)
    w = torch.randn(64, 32)

    return weighted(m, lambda m: torch.cumprod(m(x), -1), w)


def c_safe_log_where():
    m = nn.Sequential(nn.Linear(32, 32))
    x = torch.randn(64, 32)
    w = torch.randn(64, 32)

    def forward(m):
        h = m(x)
        return torch.where(h > 0, torch.log(h.clamp_min(1e-6)), torch.zeros_like(h))

    return weighted(m, forward, w)


def c_nll_2d():
    m = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 5, 1))
    x = torch.randn(4, 3, 16, 16)
    t = torch.randint(0, 5, (4, 16, 16))

    def step(m, ctx):
        ctxed(ctx, lambda: F.cross_entropy(m(x), t, label_smoothing=0.1, ignore_index=2)).backward()

    return m, step


def c_autocast_bf16():
    m = nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 10))
    x = torch.randn(64, 32)
    y = torch.randint(0, 10, (64,))

    def step(m, ctx):
        def f():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return F.cross_entropy(m(x), y)

        ctxed(ctx, f).backward()

    return m, step


def c_reentrant_ckpt():
    m = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 10))
    x = torch.randn(64, 32, requires_grad=True)
    w = torch.randn(64, 10)

    def forward(m):
        h = torch.utils.checkpoint.checkpoint(m[:3], x, use_reentrant=True)
        return m[3:](h)

    return weighted(m, forward, w)


def c_grad_accum_retain():
    m = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 10))
    x = torch.randn(64, 32)
    w = torch.randn(64, 10)

    def step(m, ctx):
        o = ctxed(ctx, lambda: m(x))
        (o * w).sum().backward(retain_graph=True)
        (o * w * 0.5).sum().backward()

    return m, step


def c_custom_function():
    class Clip(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, lo):
            ctx.save_for_backward(x, lo)
            return x.clamp(min=lo)

        @staticmethod
        def backward(ctx, g):
            x, lo = ctx.saved_tensors
            return g * (x >= lo), None

    m = nn.Sequential(nn.Linear(32, 64))
    x = torch.randn(64, 32)
    w = torch.randn(64, 64)
    lo = torch.tensor(0.1)

    return weighted(m, lambda m: Clip.apply(m(x), lo), w)


def c_glu_logsigmoid():
    m = nn.Sequential(nn.Linear(32, 128), nn.GLU(), nn.LogSigmoid(), nn.Linear(64, 10))
    x = torch.randn(64, 32)
    w = torch.randn(64, 10)

    return weighted(m, lambda m: m(x), w)


def c_cosine_sim_contrastive():
    m = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    x = torch.randn(64, 32)

    def step(m, ctx):
        def f():
            z = F.normalize(m(x), dim=-1)
            z2 = F.normalize(m(x + 0.1), dim=-1)
            logits = z @ z2.t() / 0.07
            return F.cross_entropy(logits, torch.arange(64))

        ctxed(ctx, f).backward()

    return m, step


def c_huber_smoothl1():
    m = nn.Sequential(nn.Linear(32, 32))
    x = torch.randn(64, 32)
    t = torch.randn(64, 32)

    def step(m, ctx):
        ctxed(ctx, lambda: F.huber_loss(m(x), t, delta=0.5) + F.smooth_l1_loss(m(x), t, beta=0.1)).backward()

    return m, step


def c_kl_div_log_target():
    m = nn.Sequential(nn.Linear(32, 32))
    x = torch.randn(64, 32)
    t = torch.randn(64, 32).log_softmax(-1)

    def step(m, ctx):
        ctxed(ctx, lambda: F.kl_div(m(x).log_softmax(-1), t, log_target=True, reduction="batchmean")).backward()

    return m, step


def c_pdist_cosine():
    m = nn.Sequential(nn.Linear(32, 16))
    x = torch.randn(32, 32)

    def step(m, ctx):
        ctxed(ctx, lambda: F.pdist(m(x)).sum() + F.cosine_similarity(m(x), m(x).flip(0)).sum()).backward()

    return m, step


def c_unfold_fold():
    m = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1))
    x = torch.randn(2, 3, 16, 16)
    w = torch.randn(2, 8, 16, 16)

    def forward(m):
        u = F.unfold(m(x), 3, padding=1)
        return F.fold(u.tanh(), (16, 16), 3, padding=1)

    return weighted(m, forward, w)


def c_rnn_cell_loop():
    m = nn.GRUCell(16, 32)
    x = torch.randn(30, 8, 16)
    w = torch.randn(8, 32)

    def forward(m):
        h = torch.zeros(8, 32)
        for t in range(30):
            h = m(x[t], h)
        return h

    return weighted(m, forward, w)


def c_fft_conv():
    m = nn.Sequential(nn.Linear(64, 64))
    x = torch.randn(16, 64)
    w = torch.randn(16, 64)

    def forward(m):
        h = m(x)
        H = torch.fft.rfft(h)
        return torch.fft.irfft(H * H.conj() / (H.abs() + 1e-3), n=64)

    return weighted(m, forward, w)


def c_entropy_reg():
    m = nn.Sequential(nn.Linear(32, 10))
    x = torch.randn(64, 32)

    def step(m, ctx):
        def f():
            p = m(x).softmax(-1)
            return (p * p.log()).sum() + torch.special.entr(p).sum() + torch.special.xlogy(p, p).sum()

        ctxed(ctx, f).backward()

    return m, step


def c_normalize_no_eps():
    m = nn.Sequential(nn.Linear(32, 8))
    x = torch.randn(64, 32)
    w = torch.randn(64, 8)

    return weighted(m, lambda m: m(x) / m(x).norm(dim=-1, keepdim=True), w)


def c_rms_custom():
    m = nn.Sequential(nn.Linear(32, 64))
    x = torch.randn(64, 32) * 0.01
    w = torch.randn(64, 64)

    def forward(m):
        h = m(x)
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)

    return weighted(m, forward, w)


def c_var_std():
    m = nn.Sequential(nn.Linear(32, 64))
    x = torch.randn(64, 32)
    w = torch.randn(64, 1)

    return weighted(m, lambda m: m(x).std(-1, keepdim=True) + m(x).var(-1, keepdim=True).sqrt(), w)


def c_bf16_weights():
    m = nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 10)).to(torch.bfloat16)
    x = torch.randn(64, 32, dtype=torch.bfloat16)
    y = torch.randint(0, 10, (64,))

    def step(m, ctx):
        ctxed(ctx, lambda: F.cross_entropy(m(x).float(), y)).backward()

    return m, step


def c_float64_model():
    m = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 64), nn.Softplus(), nn.Linear(64, 1)).double()
    x = torch.randn(256, 8, dtype=torch.float64)

    def step(m, ctx):
        ctxed(ctx, lambda: (m(x) - x.sum(-1, keepdim=True).sin()).pow(2).mean()).backward()

    return m, step


def c_complex_layer():
    m = nn.Linear(32, 32, dtype=torch.cfloat)
    x = torch.randn(64, 32, dtype=torch.cfloat)

    def step(m, ctx):
        ctxed(ctx, lambda: (m(x).abs() ** 2).log1p().sum()).backward()
        return torch.cat([torch.view_as_real(p.grad).flatten() for p in m.parameters()])

    return m, step


def c_torchscript():
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(32, 32)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.lin(x)
            return h / (torch.linalg.vector_norm(h, 2.0, -1, True) + 1e-3)

    m = torch.jit.script(Block())
    x = torch.randn(64, 32)
    w = torch.randn(64, 32)

    return weighted(m, lambda m: m(x), w)


def c_fx_traced():
    m = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(32, 64), nn.ReLU6(), nn.Linear(64, 64), nn.Hardswish()))
    x = torch.randn(64, 32)
    w = torch.randn(64, 64)

    return weighted(m, lambda m: m(x), w)


def c_causal_decoder():
    m = nn.TransformerDecoder(nn.TransformerDecoderLayer(32, 4, 64, dropout=0.0, batch_first=True), 2)
    x = torch.randn(4, 16, 32)
    memory = torch.randn(4, 8, 32)
    mask = nn.Transformer.generate_square_subsequent_mask(16)
    w = torch.randn(4, 16, 32)

    return weighted(m, lambda m: m(x, memory, tgt_mask=mask, tgt_is_causal=True), w)


def c_additive_inf_mask():
    m = nn.Linear(32, 96)
    x = torch.randn(4, 16, 32)
    mask = (
        torch.zeros(16, 16)
        .masked_fill(torch.rand(16, 16, generator=torch.Generator().manual_seed(3)) < 0.3, float("-inf"))
        .fill_diagonal_(0.0)
    )
    w = torch.randn(4, 16, 32)

    def forward(m):
        q, k, v = m(x).chunk(3, -1)
        scores = q @ k.transpose(-1, -2) / 32**0.5 + mask
        return scores.softmax(-1) @ v + F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    return weighted(m, forward, w)


def c_zero_rows_normalize():
    m = nn.Linear(32, 16)
    x = torch.randn(64, 32)
    x[::4] = 0.0
    w = torch.randn(64, 16)

    def forward(m):
        h = torch.relu(m(x) - 10.0 * (x.abs().sum(-1, keepdim=True) == 0))
        return F.normalize(h, dim=-1) + h.norm(dim=-1, keepdim=True)

    return weighted(m, forward, w)


def c_bidirectional_lstm_dropout():
    m = nn.LSTM(16, 32, num_layers=2, dropout=0.2, bidirectional=True, batch_first=True)
    x = torch.randn(8, 20, 16)
    w = torch.randn(8, 20, 64)

    return weighted(m, lambda m: m(x)[0], w, seed=9)


CASES = {name[2:]: make for name, make in list(globals().items()) if name.startswith("c_")}


def gradient(case: str, ctx: daftrain.compress | None, compiled: bool = False) -> torch.Tensor:
    """The setup's gradient; ``compiled``: its model under ``torch.compile`` (``aot_eager``: the graphs AOTAutograd
    makes, with the hooks inlined, without inductor's code generation)."""
    torch.manual_seed(0)
    model, step = CASES[case]()
    torch.manual_seed(1)
    if compiled:
        torch._dynamo.reset()
    grad = step(torch.compile(model, backend="aot_eager") if compiled else model, ctx)
    if grad is None:
        grad = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return grad


def measure(case: str, ref: torch.Tensor, row: dict[str, object], column: str, compiled: bool = False,
            **settings: object) -> None:
    """``row[column]``: the gradient's cosine to ``ref`` under ``compress(**settings)``, or the error raised; and
    ``row[column + "_quantized"]``: how many saves it quantized (none: the column proves nothing), compiled graphs'
    included."""
    ctx = daftrain.compress(**settings)
    try:
        row[column] = cos(gradient(case, ctx, compiled), ref)
        row[f"{column}_quantized"] = ctx.stats.compressed + ctx.stats.batched + ctx.stats.compiled_quantized
    except Exception as e:  # an error is a result: reported, not fatal
        row[column] = f"{type(e).__module__}.{type(e).__name__}: {str(e)[:160]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", default=list(CASES))
    parser.add_argument("--out", default=None, help="default: benchmarks/results/setups[_compiled].json")
    parser.add_argument("--compile", action="store_true",
                        help="each setup's model under torch.compile (aot_eager), against plain eager PyTorch")
    args = parser.parse_args()
    out = args.out or f"benchmarks/results/setups{'_compiled' if args.compile else ''}.json"
    warnings.simplefilter("ignore")
    rows = []
    for case in args.cases:
        ref = gradient(case, None)
        row: dict[str, object] = {"case": case}
        try:
            row["plain"] = cos(gradient(case, None, args.compile), ref)
        except Exception as e:  # PyTorch's own: the setup does not compile
            row["plain"] = f"{type(e).__module__}.{type(e).__name__}: {str(e)[:160]}"
        for bits in (8, 4, 2):  # every save, however small: these setups are small
            measure(case, ref, row, f"bits{bits}", args.compile, bits=bits, min_numel=0)
        measure(case, ref, row, "default", args.compile)
        rows.append(row)
        print(
            case, {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items() if k != "case"}, flush=True
        )
    write_json(out, {"command": " ".join(sys.argv), "rows": rows})


if __name__ == "__main__":
    main()
