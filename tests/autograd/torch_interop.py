#!/usr/bin/env python3
"""Our ResNet-18 checkpoint in PyTorch: runs the fixture command (argv[1:], test_autograd
--fixture torch), loads its safetensors file into a torchvision-layout ResNet-18 with
load_state_dict(strict=True), and checks that PyTorch's eval-mode logits equal ours. Proves
names, shapes, weight layouts and batch-norm buffers map onto torchvision. The files are read
with tests/torch_support.py's reader (no safetensors package).

Then our f32 and bf16 mixed-precision SGD steps of a narrower ResNet-18 against PyTorch's f32
and bf16-autocast steps from the same weights on the same batches (compare_mixed_precision); and
a RegNetY in ClassyVision's layout, loaded strictly, its logits and input gradient against ours
(compare_regnet); and an EfficientNet the same way (compare_efficientnet).

Exit 77 (skipped) when no python3 at hand has PyTorch (Debian: apt-get install python3-torch)."""
import os
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from torch_support import load_safetensors, ours_env, require_torch  # noqa: E402

torch = require_torch("torch_interop", __file__)

# The same torchvision-layout ResNet-18 the benchmark peer measures.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks", "autograd"))
from torch_resnet18 import ResNet18  # noqa: E402
from torch_regnet import regnet_in_torch  # noqa: E402
from torch_efficientnet import efficientnet_in_torch  # noqa: E402


def torch_losses(fixture, autocast):
    """The fixture's SGD steps in PyTorch from the same weights: f32, or f32 parameters under
    torch.autocast("cpu", torch.bfloat16) (PyTorch's CPU mixed precision)."""
    torch.manual_seed(0)
    model = ResNet18(10, small_image_stem=True, base_channels=16)
    model.load_state_dict({k[len("init."):]: v for k, v in fixture.items() if k.startswith("init.")},
                          strict=True)
    model.train()
    lr, momentum, weight_decay = fixture["lr_momentum_weight_decay"].tolist()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum,
                                weight_decay=weight_decay)
    losses = []
    for images, labels in zip(fixture["images"], fixture["labels"]):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(images)
        loss = torch.nn.functional.cross_entropy(logits.float(), labels)
        losses.append(loss.item())
        loss.backward()
        optimizer.step()
    return torch.tensor(losses), {k: v.detach().clone() for k, v in model.named_parameters()}


def compare_mixed_precision(fixture, ours_f32_params, ours_bf16_params):
    """Our bf16 mixed-precision steps against PyTorch's bf16 autocast. The two round different
    things (we keep a bf16 compute copy of the weights and store activations in bf16; autocast
    casts weights per op and keeps some ops' outputs f32), so they cannot agree bit for bit:
    the test asks that our bf16 run is as close to PyTorch's bf16 run as the two bf16 runs are
    to f32, i.e. that both make errors of the size bf16 rounding makes, and that our f32 run
    equals PyTorch's."""
    ours_f32, ours_bf16 = fixture["loss_f32"].double(), fixture["loss_bf16"].double()
    torch_f32, torch_f32_params = torch_losses(fixture, autocast=False)
    torch_bf16, torch_bf16_params = torch_losses(fixture, autocast=True)
    torch_f32, torch_bf16 = torch_f32.double(), torch_bf16.double()

    def rel(a, b):
        return ((a - b).abs() / b.abs()).max().item()

    # The training's net change to the parameters, all of them in one vector.
    init = {k[len("init."):]: v for k, v in fixture.items() if k.startswith("init.")}

    def update(params):
        return torch.cat([(params[k].double() - init[k].double()).flatten() for k in sorted(torch_f32_params)])

    def rel_update(a, b):
        return ((update(a) - update(b)).norm() / update(b).norm()).item()

    upd_f32_gap = rel_update(ours_f32_params, torch_f32_params)
    upd_cross = rel_update(ours_bf16_params, torch_bf16_params)
    upd_ours_err = rel_update(ours_bf16_params, torch_f32_params)
    upd_torch_err = rel_update(torch_bf16_params, torch_f32_params)

    f32_gap = rel(ours_f32, torch_f32)
    cross = rel(ours_bf16, torch_bf16)
    ours_err, torch_err = rel(ours_bf16, torch_f32), rel(torch_bf16, torch_f32)
    print("per-step losses (f32 torch / ours bf16 / torch bf16 autocast):",
          " ".join(f"{a:.4f}/{b:.4f}/{c:.4f}" for a, b, c in zip(torch_f32.tolist(),
                                                               ours_bf16.tolist(),
                                                               torch_bf16.tolist())))
    print(f"max relative loss difference over {len(ours_f32)} steps: ours f32 vs torch f32 "
          f"{f32_gap:.2e}; ours bf16 vs torch bf16 autocast {cross:.2e}; vs f32: ours bf16 "
          f"{ours_err:.2e}, torch bf16 {torch_err:.2e}")
    print(f"relative difference of the parameter updates (L2): ours f32 vs torch f32 "
          f"{upd_f32_gap:.2e}; ours bf16 vs torch bf16 autocast {upd_cross:.2e}; vs f32: ours "
          f"bf16 {upd_ours_err:.2e}, torch bf16 {upd_torch_err:.2e}")
    # (each bound with what its failure means)
    checks = [
        (f32_gap <= 1e-4, "our f32 training steps differ from PyTorch's"),
        (cross <= 2 * max(ours_err, torch_err) + 1e-3,
         "our bf16 steps are further from PyTorch's bf16 autocast than bf16 rounding explains"),
        (upd_f32_gap <= 1e-3, "our f32 parameter updates differ from PyTorch's"),
        (upd_cross <= 2 * max(upd_ours_err, upd_torch_err) + 1e-3,
         "our bf16 updates are further from PyTorch's bf16 autocast than bf16 rounding explains"),
        (ours_err <= 0.05, "our bf16 losses are more than 5% from f32"),
    ]
    for held, failure in checks:
        if not held:
            print("FAIL: " + failure)
    ok = all(held for held, _ in checks)
    return ok


def compare_network(what, model, state, io, output):
    """A network of ours rebuilt in PyTorch: the state dict's names and shapes (loaded strictly),
    the eval-mode `output` for io's images, the input's and every parameter's gradient for io's
    upstream gradient, each within 1e-4 of its size."""
    ours, theirs = set(state), set(model.state_dict())
    if ours != theirs:
        print(f"{what}: state-dict names differ; only ours:", sorted(ours - theirs)[:8],
              "only torch's:", sorted(theirs - ours)[:8])
        return False
    model.load_state_dict(state, strict=True)
    model.eval()
    images = io["images"].clone().requires_grad_(True)
    result = model(images)
    result.backward(io["upstream"])
    diff = (result.detach() - io[output]).abs().max().item()
    scale = io[output].abs().max().item()
    grad_diff = (images.grad - io["grad_images"]).abs().max().item()
    grad_scale = io["grad_images"].abs().max().item()
    # Every parameter's gradient, relative to its own size (the worst one reported).
    worst, worst_name = 0.0, ""
    for name, p in model.named_parameters():
        ours = io["grad." + name]
        rel = ((p.grad - ours).norm() / max(ours.norm().item(), 1e-30)).item()
        if rel > worst:
            worst, worst_name = rel, name
    print(f"{what}: {len(state)} tensors loaded strictly; max |torch - shardkit| {output} "
          f"{diff:.3g} (up to {scale:.3g}), input gradient {grad_diff:.3g} (up to "
          f"{grad_scale:.3g}); parameter gradients within {worst:.2g} (relative L2, worst "
          f"{worst_name})")
    if not (diff <= 1e-4 * scale + 1e-7 and grad_diff <= 1e-4 * grad_scale + 1e-7 and
            worst <= 1e-4):
        print(f"FAIL: PyTorch's {what} differs from ours")
        return False
    return True


def compare_regnet(state, io):
    """Our RegNetY (an AnyNet in ClassyVision's names) in PyTorch."""
    model = regnet_in_torch(torch, [(8, 2, 1, 4, 1.0), (16, 2, 2, 8, 1.0), (24, 1, 1, 8, 1.0)], 8,
                            10)
    return compare_network("RegNetY (AnyNet, ClassyVision's names)", model, state, io, "logits")


def compare_efficientnet(state, io):
    """Our EfficientNet (B0's blocks at width 0.25, depth 0.5) in PyTorch."""
    model = efficientnet_in_torch(torch, 0.25, 0.5)
    return compare_network("EfficientNet (B0's blocks at width 0.25, depth 0.5, VISSL's names)",
                           model, state, io, "features")


def main():
    fixture = sys.argv[1:]  # the fixture command: test_autograd --fixture torch
    folder = tempfile.mkdtemp(prefix="shardkit_torch_interop_")
    try:
        subprocess.run(fixture + [folder], check=True, env=ours_env())
        state = load_safetensors(os.path.join(folder, "model.safetensors"))
        io = load_safetensors(os.path.join(folder, "io.safetensors"))
        mixed = load_safetensors(os.path.join(folder, "mixed.safetensors"))
        ours_f32 = load_safetensors(os.path.join(folder, "ours_f32", "model.safetensors"))
        ours_bf16 = load_safetensors(os.path.join(folder, "ours_bf16", "model.safetensors"))
        regnet_state = load_safetensors(os.path.join(folder, "regnet.safetensors"))
        regnet_io = load_safetensors(os.path.join(folder, "regnet_io.safetensors"))
        efficientnet_state = load_safetensors(os.path.join(folder, "efficientnet.safetensors"))
        efficientnet_io = load_safetensors(os.path.join(folder, "efficientnet_io.safetensors"))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    model = ResNet18(10, small_image_stem=True)
    ours, theirs = set(state), set(model.state_dict())
    if ours != theirs:
        print("state-dict names differ; only ours:", sorted(ours - theirs)[:8],
              "only torch's:", sorted(theirs - ours)[:8])
        return 1
    model.load_state_dict(state, strict=True)
    model.eval()
    with torch.no_grad():
        logits = model(io["images"])
    expected = io["logits"]
    scale = expected.abs().max().item()
    diff = (logits - expected).abs().max().item()
    print(f"torch {torch.__version__}: {len(state)} tensors loaded strictly; "
          f"max |torch - shardkit| = {diff:.3g} (logits up to {scale:.3g})")
    if not diff <= 1e-4 * scale + 1e-7:
        print("FAIL: PyTorch's logits differ from ours")
        return 1
    regnet_ok = compare_regnet(regnet_state, regnet_io)
    efficientnet_ok = compare_efficientnet(efficientnet_state, efficientnet_io)
    return (0 if compare_mixed_precision(mixed, ours_f32, ours_bf16) and regnet_ok and
            efficientnet_ok else 1)


if __name__ == "__main__":
    sys.exit(main())
