"""Cross-entropy over a wide linear layer (saved/linear_cross_entropy.py): under ``compress`` it runs as a function
of the layer's input, weight and bias, with the loss and gradients of plain PyTorch to float rounding, nothing of
the logits' size saved or made in backward, and only where its logits are that layer's whole, unchanged output."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import CreatedTensors

import daftrain
from daftrain.errors import UnsupportedError
from daftrain.saved import linear_cross_entropy
from daftrain.saved.op_rules import ExactSavings

ROWS, FEATURES, CLASSES = 1200, 64, 2000
# Float32 rounding: the chunks sum the loss and the weight's and bias's gradients over rows in another order than
# one matmul does (relative error ~ sqrt(rows) * 2**-24 ~ 1e-6 at most here; measured ~1e-8).
RTOL = 1e-5


def _problem(seed: int = 0, bias: bool = True, device: str = "cpu") -> tuple[torch.nn.Linear, torch.Tensor,
                                                                             torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    head = torch.nn.Linear(FEATURES, CLASSES, bias=bias)
    h = torch.randn(4, ROWS // 4, FEATURES, generator=gen) * 3
    target = torch.randint(0, CLASSES, (ROWS,), generator=gen)
    target[::7] = -100  # ignored rows
    return head.to(device), h.to(device), target.to(device)


def _small_tiles(monkeypatch: pytest.MonkeyPatch, device: str) -> None:
    """Tiles of 500 rows by 900 classes: three of each, the last partial; forward's chunks of 225 rows."""
    monkeypatch.setitem(linear_cross_entropy.CHUNK_BYTES, device, 500 * 900 * 4)
    monkeypatch.setattr(linear_cross_entropy, "TILE_ROWS", 500)


def _grads(head: torch.nn.Linear, h: torch.Tensor) -> torch.Tensor:
    """The gradients there are (a frozen weight or bias has none)."""
    parts = [head.weight.grad, h.grad, None if head.bias is None else head.bias.grad]
    return torch.cat([p.flatten() for p in parts if p is not None])


def _run(head: torch.nn.Linear, h0: torch.Tensor, target: torch.Tensor, ctx: daftrain.compress | None,
         hold_logits: bool = False, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[no-untyped-def]
    head.zero_grad()
    h = h0.clone().requires_grad_()
    with ctx if ctx is not None else torch.enable_grad():
        logits = head(h)  # [4, ROWS / 4, CLASSES], viewed as rows below as a language model's loss does
        loss = F.cross_entropy(logits.view(-1, CLASSES), target, **kwargs)
    if not hold_logits:
        del logits  # the usual case: backward recomputes each chunk's logits
    loss.backward()
    return loss.detach(), _grads(head, h)


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=RTOL, atol=RTOL * b.abs().max().item())


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("hold_logits", [False, True])
def test_loss_and_gradients_are_plain_to_rounding(reduction: str, bias: bool, hold_logits: bool, device: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    _small_tiles(monkeypatch, device)
    head, h, target = _problem(bias=bias, device=device)
    plain_loss, plain_grad = _run(head, h, target, None, reduction=reduction)
    ctx = daftrain.compress(bits=2)
    loss, grad = _run(head, h, target, ctx, hold_logits=hold_logits, reduction=reduction)
    _close(loss, plain_loss)
    _close(grad, plain_grad)  # exact logits: closer to plain than the 8-bit logits the other path saves
    assert ctx.stats.compressed == 0  # nothing quantized: the head's input is kept exact, the logits not saved


@pytest.mark.parametrize("frozen", [False, True])
@pytest.mark.parametrize("half", ["autocast", "bfloat16"])
def test_a_bfloat16_head_is_taken_with_its_own_arithmetic(half: str, frozen: bool, device: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # A bfloat16 output cast up for the loss (Hugging Face's logits.float()): under autocast (float32 weights) or of
    # a bfloat16 model. Backward recomputes the logits in bfloat16, as the layer computed them, and runs the
    # gradients' matmuls in bfloat16, as plain's backward does; a frozen head's input gradient is made in forward
    # from the logits the layer made, with the same bfloat16 matmul.
    _small_tiles(monkeypatch, device)
    runs = []
    for precision, ctx in ((half, None), (half, daftrain.compress(bits=8)), ("float64", None)):
        head, h0, target = _problem(device=device)
        h = h0.clone()
        if precision != "autocast":
            dtype = torch.float64 if precision == "float64" else torch.bfloat16
            head, h = head.to(dtype), h.to(dtype)
        head.weight.requires_grad_(not frozen)
        h.requires_grad_()
        with torch.autocast(device, dtype=torch.bfloat16, enabled=precision == "autocast"), \
                ctx if ctx is not None else torch.enable_grad():
            logits = head(h)
            loss = F.cross_entropy(logits.to(torch.float64 if precision == "float64" else torch.float32)
                                   .view(-1, CLASSES), target)
        node = type(loss.grad_fn).__name__
        del logits
        loss.backward()
        grads = _grads(head, h).double()
        runs.append((loss.detach(), grads, node))
    (plain_loss, plain_grad, _), (loss, grad, node), (_, exact, _) = runs
    assert node == "_OverLinearBackward"
    _close(loss, plain_loss)  # the loss of the same float32 copy, summed in chunks

    def error(g: torch.Tensor) -> float:
        return ((g - exact).norm() / exact.norm()).item()

    # Against float64 arithmetic plain's bfloat16 gradient is off by ~2.5e-3. Ours rounds where plain's does, and
    # more often on CPU: the input's gradient a partial per block of classes (rounded to bfloat16, summed in
    # float32), and a recomputed logit may round to the neighbouring bfloat16 value; measured 0.98-1.19x plain's
    # error on CPU, 0.74-1.00x on CUDA (partials written in float32 by the matmul).
    assert error(grad) <= 1.25 * error(plain_grad)


@pytest.mark.parametrize("ignore_index", [0, 899, 1999])
def test_an_ignored_class_inside_the_vocabulary_is_ignored(ignore_index: int, device: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # the ignored index is a class of some tile (899: the last of the first block of 900 classes), so the rows
    # that carry it fall in that tile and must take nothing from it
    _small_tiles(monkeypatch, device)
    head, h, target = _problem(device=device)
    target[target == -100] = ignore_index
    target[::3] = ignore_index
    plain_loss, plain_grad = _run(head, h, target, None, ignore_index=ignore_index)
    ctx = daftrain.compress(bits=2)
    loss, grad = _run(head, h, target, ctx, ignore_index=ignore_index)
    _close(loss, plain_loss)
    _close(grad, plain_grad)
    assert ctx.stats.compressed == 0  # the loss ran over the layer: no logits saved


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("bias_grad", [True, False])
def test_a_frozen_heads_gradients_come_from_forward(reduction: str, bias_grad: bool, device: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # NOTE [ A frozen head's input gradient, computed in forward ]: a head whose weight takes no gradient (adapters)
    _small_tiles(monkeypatch, device)
    head, h0, target = _problem(device=device)
    head.weight.requires_grad_(False)
    head.bias.requires_grad_(bias_grad)
    results = []
    for ctx in (None, daftrain.compress(bits=2)):
        head.zero_grad()
        h = h0.clone().requires_grad_()
        with ctx if ctx is not None else torch.enable_grad():
            loss = F.cross_entropy(head(h).view(-1, CLASSES), target, reduction=reduction)
        probe = CreatedTensors()
        with probe:
            (first,) = torch.autograd.grad(3 * loss, h, retain_graph=True)  # a loss gradient other than 1
        loss.backward()  # again, through the same graph
        results.append((loss.detach(), first, _grads(head, h), max(probe.numels)))
    (plain_loss, plain_first, plain_grad, _), (loss, first, grad, largest) = results
    _close(loss, plain_loss)
    _close(first, plain_first)
    _close(grad, plain_grad)
    assert largest == ROWS * FEATURES  # the input's gradient times the loss's: no tile, no logits recomputed


@pytest.mark.parametrize("in_place", [True, False])
def test_the_weight_gradient_is_added_into_grad_where_asked(in_place: bool, device: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    # NOTE [ Weight gradients accumulated in place ] (budget/weight_grads.py): the second backward adds its tiles
    # into the .grad the first made, with no tensor of the weight's size; without it autograd adds a new one in
    _small_tiles(monkeypatch, device)
    head, h0, target = _problem(device=device)
    plain = copy.deepcopy(head)
    savings = ExactSavings(weight_grads_in_place=in_place)
    for _ in range(2):
        F.cross_entropy(plain(h0).view(-1, CLASSES), target).backward()
        with savings:
            loss = F.cross_entropy(head(h0.clone().requires_grad_()).view(-1, CLASSES), target)
        grad, probe = head.weight.grad, CreatedTensors()
        with probe:
            loss.backward()
    assert head.weight.grad is grad  # added into (by autograd's AccumulateGrad too, from a tensor of its own)
    assert (CLASSES * FEATURES in probe.numels) != in_place
    _close(head.weight.grad, plain.weight.grad)
    _close(head.bias.grad, plain.bias.grad)


def test_every_row_ignored_gives_what_plain_gives() -> None:
    head, h, target = _problem()
    target.fill_(-100)
    for reduction in ("mean", "sum"):
        plain = _run(head, h, target, None, reduction=reduction)
        ours = _run(head, h, target, daftrain.compress(bits=2), reduction=reduction)
        for a, b in zip(ours, plain, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("frozen", [False, True])
def test_double_backward_matches_plain(frozen: bool) -> None:
    head, h0, target = _problem()
    head.weight.requires_grad_(not frozen)

    def second(ctx: daftrain.compress | None) -> tuple[torch.Tensor, torch.Tensor]:
        h = h0.clone().requires_grad_()
        with ctx if ctx is not None else torch.enable_grad():
            loss = F.cross_entropy(head(h).view(-1, CLASSES), target)
        (g,) = torch.autograd.grad(loss, h, create_graph=True)
        (gg,) = torch.autograd.grad(g.square().sum(), h)
        return g, gg

    # under create_graph the backward runs the same ops as plain on the whole tensor
    for a, b in zip(second(daftrain.compress(bits=2)), second(None), strict=True):
        assert torch.equal(a, b)


def test_nothing_of_the_logits_size_is_saved_or_made_in_backward(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(linear_cross_entropy.CHUNK_BYTES, device, 300 * CLASSES * 4)
    largest = []
    for ctx in (daftrain.compress(bits=8, linear_cross_entropy=False), daftrain.compress(bits=8)):
        head, h0, target = _problem(device=device)
        h = h0.clone().requires_grad_()
        with ctx:
            loss = F.cross_entropy(head(h).view(-1, CLASSES), target)
        probe = CreatedTensors()
        with probe:
            loss.backward()
        largest.append(max(probe.numels))
    assert largest[0] == ROWS * CLASSES  # the logits' gradient (the logits decoded besides, by the unpack)
    assert largest[1] == 300 * CLASSES  # one tile of CHUNK_BYTES (the weight's gradient, 2000 x 64, is smaller)


def test_a_narrow_layer_saves_its_logits() -> None:
    # 2000 classes from 1024 features: the input exact would take more bytes than the logits at 8 bits
    head = torch.nn.Linear(1024, CLASSES)
    h = torch.randn(ROWS, 1024, requires_grad=True)
    with daftrain.compress(bits=2) as ctx:
        loss = F.cross_entropy(head(h), torch.randint(0, CLASSES, (ROWS,)))
    loss.backward()
    assert ctx.stats.compressed == 1  # the logits (the layer's input is a leaf that requires grad: kept)
    assert ctx.stats.packed_bytes > ROWS * CLASSES  # at 8 bits, not 2


def _logits_from(head: torch.nn.Linear, h: torch.Tensor, how: str) -> torch.Tensor:
    logits = head(h)
    if how == "in_place":
        return logits.mul_(0.5).view(-1, CLASSES)
    if how == "sliced":
        return logits[:, 1:].reshape(-1, CLASSES)
    if how == "another_layer":
        head(h)  # a later call of the same layer: the logits are not its output
        return logits.view(-1, CLASSES)
    return (logits * 1.0).view(-1, CLASSES)  # "computed": a new tensor from the output


@pytest.mark.parametrize("how", ["in_place", "sliced", "another_layer", "computed"])
def test_logits_that_are_not_the_whole_unchanged_output_are_saved(how: str) -> None:
    head, h0, target = _problem()
    results = []
    for ctx in (None, daftrain.compress(bits=8)):
        head.zero_grad()
        h = h0.clone().requires_grad_()
        with ctx if ctx is not None else torch.enable_grad():
            logits = _logits_from(head, h, how)
            loss = F.cross_entropy(logits, target[:logits.shape[0]])
        loss.backward()
        results.append((loss.detach(), _grads(head, h), ctx.stats.compressed if ctx is not None else None))
    (plain_loss, plain_grad, _), (loss, grad, compressed) = results
    assert torch.equal(loss, plain_loss)  # the logits-saving function: plain's loss bit for bit
    assert compressed >= 1  # its logits saved at 8 bits
    assert F.cosine_similarity(grad.double(), plain_grad.double(), dim=0).item() >= 0.999


def test_input_written_after_the_layer_is_not_recomputed_from() -> None:
    head, h0, target = _problem()
    h = h0.clone().requires_grad_()
    x = h * 1.0
    with daftrain.compress(bits=8) as ctx:
        logits = head(x)
        x.add_(1.0)  # the layer's input changed: its output no longer follows from it
        loss = F.cross_entropy(logits.view(-1, CLASSES), target)
    assert type(loss.grad_fn).__name__ == "_SavingLogitsBackward"
    assert ctx.stats.compressed >= 1  # the logits were saved instead


def test_a_hook_on_the_output_keeps_the_loss_through_the_layer() -> None:
    # FSDP gathers a resharded module's weight from a hook on the module's output, run when its gradient arrives;
    # the function over the layer would never send one there. Here the weight is freed after forward as FSDP
    # frees it, and the hook gathers it again.
    head, h0, target = _problem()
    kept = head.weight.detach().clone()
    gathered = []

    def gather(grad: torch.Tensor) -> None:
        gathered.append(True)
        head.weight.untyped_storage().resize_(kept.numel() * kept.element_size())
        with torch.no_grad():
            head.weight.copy_(kept)

    plain_grad = _run(head, h0, target, None)[1]
    head.zero_grad()
    h = h0.clone().requires_grad_()
    with daftrain.compress(bits=8):
        out = head(h.view(-1, FEATURES))  # the logits themselves (a hook on a view between is not seen)
        out.register_hook(gather)
        loss = F.cross_entropy(out, target)
    del out
    assert type(loss.grad_fn).__name__ == "_SavingLogitsBackward"
    head.weight.untyped_storage().resize_(0)
    loss.backward()
    assert gathered and F.cosine_similarity(_grads(head, h).double(), plain_grad.double(), dim=0).item() >= 0.999


def test_a_weight_freed_before_backward_raises() -> None:
    head, h0, target = _problem()
    kept = head.weight.detach().clone()
    with daftrain.compress(bits=8):
        loss = F.cross_entropy(head(h0.clone().requires_grad_()).view(-1, CLASSES), target)
    head.weight.untyped_storage().resize_(0)
    try:
        with pytest.raises(UnsupportedError, match="linear_cross_entropy=False"):
            loss.backward()
    finally:
        head.weight.untyped_storage().resize_(kept.numel() * kept.element_size())
        with torch.no_grad():
            head.weight.copy_(kept)


def test_the_option_turns_it_off() -> None:
    head, h0, target = _problem()
    with daftrain.compress(bits=8, linear_cross_entropy=False):
        loss = F.cross_entropy(head(h0.clone().requires_grad_()).view(-1, CLASSES), target)
    assert type(loss.grad_fn).__name__ == "_SavingLogitsBackward"


def test_config_rejects_a_non_bool() -> None:
    with pytest.raises(daftrain.errors.ArgumentTypeError, match="linear_cross_entropy"):
        daftrain.CompressionConfig(linear_cross_entropy=1)  # type: ignore[arg-type]


@pytest.mark.parametrize("lora", [False, True])
def test_a_language_models_own_loss_is_taken(lora: bool) -> None:
    # Hugging Face's causal LM loss: the head's [batch, seq, vocab] output viewed as rows, in its own loss function;
    # with LoRA the head (tied to the frozen embedding) takes no gradient and its input's comes from forward
    from daftrain.demo.models.transformers_zoo import gpt2_lm

    model = gpt2_lm(n_layer=2, n_embd=32, n_head=2, n_positions=64, vocab_size=1000, dropout=0.0, seed=0)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True))
        assert not model.get_output_embeddings().weight.requires_grad
    ids = torch.randint(0, 1000, (2, 64), generator=torch.Generator().manual_seed(1))
    runs = []
    for ctx in (None, daftrain.compress(bits=8)):
        model.zero_grad()
        with ctx if ctx is not None else torch.enable_grad():
            loss = model(input_ids=ids, labels=ids).loss
        runs.append((loss.detach(), type(loss.grad_fn).__name__))
        loss.backward()
        runs[-1] += (torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad]),)
    (plain_loss, _, plain_grad), (loss, node, grad) = runs
    assert node == "_OverLinearBackward"
    _close(loss, plain_loss)  # 8 bits changes backward only; the forward is plain's to the loss's summation order
    assert F.cosine_similarity(grad.double(), plain_grad.double(), dim=0).item() >= 0.999


def _zoo_language_models() -> list[str]:
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
    )

    from daftrain.demo.models.transformers_zoo import TINY_ZOO

    return [m for m, kind, _ in TINY_ZOO if (kind == "text" and m in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
            or (kind == "seq2seq" and m in MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES)]


# The heads that scale, soft-cap or offset their logits before the loss: the logits are not the head's output.
_LOGITS_CHANGED_AFTER_THE_HEAD = {"cohere", "cohere2", "gemma2", "granite", "granitemoe", "recurrent_gemma", "bart",
                                  "mbart", "marian", "pegasus", "blenderbot", "led"}


@pytest.mark.slow
@pytest.mark.parametrize("model_type", _zoo_language_models())
def test_every_language_model_of_the_zoo(model_type: str) -> None:
    # Each of the zoo's causal and sequence-to-sequence language models, with its own loss over a 2048-token
    # vocabulary (wide over its 64 hidden values): the loss runs over its head unless the model changes its
    # logits after the head, and the gradient at 8 bits is plain's to the zoo's 8-bit target.
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM

    from daftrain.demo.models.transformers_zoo import _TINY_COMMON, TINY_ZOO

    _, kind, overrides = next(e for e in TINY_ZOO if e[0] == model_type)
    kwargs = {k: v for k, v in {**_TINY_COMMON, **overrides, "vocab_size": 2048}.items() if v is not None}
    config = AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(0)
    model = (AutoModelForCausalLM if kind == "text" else AutoModelForSeq2SeqLM).from_config(config).train()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 2048, (2, 32), generator=gen)
    labels = ids if kind == "text" else torch.randint(3, 2048, (2, 16), generator=gen)
    runs = []
    for ctx in (None, daftrain.compress(bits=8)):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)  # the same dropout masks
        with ctx if ctx is not None else torch.enable_grad():
            loss = model(input_ids=ids, labels=labels).loss
        node = type(loss.grad_fn).__name__
        loss.backward()
        runs.append((node, torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])))
    (_, plain), (node, grad) = runs
    assert node == ("_SavingLogitsBackward" if model_type in _LOGITS_CHANGED_AFTER_THE_HEAD else "_OverLinearBackward")
    assert F.cosine_similarity(grad.double(), plain.double(), dim=0).item() >= 0.999
