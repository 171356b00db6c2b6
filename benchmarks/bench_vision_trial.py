"""``compress`` on image classifiers from torchvision and timm, tried as a new user would.

Neither library is a dependency of daftrain: install them yourself (a torchvision build that matches the
installed torch). Each model is built untrained with 10 classes, in train mode, and runs one forward and
backward on a random batch (``--batch`` images of ``--size`` pixels; ViT-style timm models are built for that
size) in plain PyTorch and under ``compress`` with the same seeds, the loss a fixed random projection of the
logits (``zoo_gradient``, as the zoo benchmarks). Per model: plain PyTorch deterministic, exact mode
bit-identical, the gradient cosine against plain at 8, 4 and 2 bits, every gradient finite, and the
saved-bytes ratio; with ``--error-share``, the same for ``bits="auto", error_share=...`` (its third step, as
``bench_zoo.py``'s ``share`` column). An exception is a row with ``error``. Models whose classifier starts at
zero (torchvision's ViT, timm's MLP-Mixer) are left out: no gradient reaches below it, so every mode matches
plain exactly; ``nonzero`` is the share of gradient entries that are not zero, which shows such a model.

    .venv/bin/python benchmarks/bench_vision_trial.py --out benchmarks/results/vision_trial.json
    .venv/bin/python benchmarks/bench_vision_trial.py --error-share 0.01 --models torchvision/efficientnet_b0 ... \
        --out benchmarks/results/vision_trial_share.json
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_zoo import share_gradient
from common import measured, recorded, write_json

import daftrain
from daftrain.demo.models.transformers_zoo import zoo_gradient

TORCHVISION = ("resnet18", "resnet50", "resnext50_32x4d", "wide_resnet50_2", "densenet121", "mobilenet_v2",
               "mobilenet_v3_small", "mobilenet_v3_large", "efficientnet_b0", "efficientnet_v2_s", "mnasnet0_5",
               "regnet_y_400mf", "shufflenet_v2_x0_5", "squeezenet1_0", "convnext_tiny", "alexnet", "vgg11_bn",
               "swin_t")
TIMM = ("resnet50d", "efficientnet_b0", "mobilenetv3_large_100", "mobilenetv4_conv_small", "lcnet_050",
        "tinynet_a", "rexnet_100", "ghostnet_100", "hgnetv2_b0", "repvgg_a0", "regnety_002", "dla34",
        "cspdarknet53", "nf_resnet26", "convnext_atto", "edgenext_xx_small", "poolformer_s12", "mobilevit_xxs",
        "levit_128s", "vit_tiny_patch16_224", "xcit_nano_12_p16_224")
_TIMM_SIZED = ("vit", "xcit", "levit")
"""timm families built for the input size (their position embeddings or attention biases have a fixed size)."""


class _Logits(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"logits": self.inner(x)}


def build(name: str, size: int) -> torch.nn.Module:
    """``torchvision/<name>`` or ``timm/<name>``, untrained, 10 classes, train mode, from seed 0."""
    library, _, model = name.partition("/")
    torch.manual_seed(0)
    if library == "torchvision":
        import torchvision

        # torchvision's Swin is built for 224 pixels (its attention windows); the others take any size
        inner = getattr(torchvision.models, model)(num_classes=10)
    elif library == "timm":
        import timm

        sized = {"img_size": size} if model.startswith(_TIMM_SIZED) else {}
        inner = timm.create_model(model, pretrained=False, num_classes=10, **sized)
    else:
        raise SystemExit(f"unknown library in {name!r}: use torchvision/<model> or timm/<model>")
    return _Logits(inner).train()


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0))


def run_model(name: str, batch: int, size: int, share: float | None = None) -> dict[str, Any]:
    row: dict[str, Any] = {"model": name}
    with recorded(row):
        model = build(name, size)
        pixels = 224 if name == "torchvision/swin_t" else size
        torch.manual_seed(1)
        inputs = {"x": torch.randn(batch, 3, pixels, pixels)}
        ref = zoo_gradient(model, inputs, None)
        row["plain_deterministic"] = bool(torch.equal(ref, zoo_gradient(model, inputs, None)))
        row["nonzero"] = float((ref != 0).double().mean())
        row["exact_identical"] = bool(torch.equal(zoo_gradient(model, inputs, daftrain.compress(bits=None)), ref))
        for bits in (8, 4, 2):
            ctx = daftrain.compress(bits=bits, model=model)
            grad = zoo_gradient(model, inputs, ctx)
            row[f"cos{bits}"], row[f"ratio{bits}"] = _cos(grad, ref), ctx.stats.ratio
            row[f"finite{bits}"] = bool(grad.isfinite().all())
        if share is not None:
            grad, _, forward = share_gradient(model, inputs, share)
            row["cosshare"], row["ratioshare"] = _cos(grad, ref), forward.ratio
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", help="torchvision/<name> or timm/<name> (default: the lists above)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--error-share", type=float, help="also bits='auto' with this error_share")
    parser.add_argument("--out", default="benchmarks/results/vision_trial.json")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    names = args.models or [*(f"torchvision/{m}" for m in TORCHVISION), *(f"timm/{m}" for m in TIMM)]
    rows = []
    for name in names:
        row = run_model(name, args.batch, args.size, args.error_share)
        rows.append(row)
        print(name, row["status"], row.get("error", ""),
              {k: round(v, 4) for k, v in row.items() if k.startswith(("cos", "ratio"))}, flush=True)
    ok, summary = measured(rows)
    summary.update({"exact_not_identical": [r["model"] for r in ok if not r["exact_identical"]],
                    "bits8_under_0.999": {r["model"]: r["cos8"] for r in ok if r["cos8"] < 0.999},
                    "bits4_under_0.98": {r["model"]: r["cos4"] for r in ok if r["cos4"] < 0.98},
                    "bits2_under_0.5": {r["model"]: r["cos2"] for r in ok if r["cos2"] < 0.5}})
    if args.error_share is not None:
        summary["share_under_0.99"] = {r["model"]: r["cosshare"] for r in ok if r["cosshare"] < 0.99}
    for key, value in summary.items():
        print(f"{key}: {value}")
    write_json(args.out, {"command": ".venv/bin/python benchmarks/bench_vision_trial.py " + " ".join(sys.argv[1:]),
                          "batch": args.batch, "size": args.size, "summary": summary, "rows": rows})


if __name__ == "__main__":
    main()
