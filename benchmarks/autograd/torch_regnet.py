"""ClassyVision's RegNet in PyTorch, written from ClassyVision's anynet.py and regnet.py: the
reference our nn::RegNet (include/shardkit/nn/regnet.hpp) follows, for tests/autograd/
torch_interop.py (our state dict loaded strictly, logits and gradients compared) and the CPU
benchmark's peer (compare_regnet_cpu.py). torch is passed in: each caller finds its own."""
import math
from collections import OrderedDict


def regnet_stages(depth, w_0, w_a, w_m, group_width, bottleneck_multiplier=1.0):
    """ClassyVision's RegNetParams.get_expanded_params: (width, stride, depth, group_width,
    bottleneck_multiplier) per stage. Python's round() halves to even, as numpy.round."""
    widths = []
    for j in range(depth):
        capacity = round(math.log((j * w_a + w_0) / w_0) / math.log(w_m))
        widths.append(int(round(w_0 * w_m ** capacity / 8) * 8))
    stages = []
    for j, w in enumerate(widths):
        if j == 0 or w != widths[j - 1]:
            stages.append([w, 2, 0, group_width, bottleneck_multiplier])
        stages[-1][2] += 1
    for s in stages:
        bottleneck = int(s[0] * s[4])
        s[3] = min(s[3], bottleneck)
        s[0] = int(int(round(bottleneck / s[3]) * s[3]) / s[4])
    return [tuple(s) for s in stages]


def regnet_in_torch(torch, stages, stem_width, classes, se_ratio=0.25, stem="simple_stem_in"):
    """ClassyVision's AnyNet of ResBottleneckBlocks with squeeze-and-excitation (RegNetY) and a
    simple_stem_in stem, in VISSL's feature-block names (conv1, res2, ...) with ClassyVision's
    inside: written from ClassyVision's anynet.py, as the reference our nn::RegNet follows.
    stages: (width, stride, depth, group_width, bottleneck_multiplier); stem: simple_stem_in
    (3 x 3 stride 2) or res_stem_cifar (3 x 3 stride 1)."""
    nn = torch.nn

    class SqueezeExcitation(nn.Module):
        def __init__(self, width, reduced):
            super().__init__()
            self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
            self.excitation = nn.Sequential(nn.Conv2d(width, reduced, 1, bias=True), nn.ReLU(),
                                            nn.Conv2d(reduced, width, 1, bias=True), nn.Sigmoid())

        def forward(self, x):
            return x * self.excitation(self.avgpool(x))

    class BottleneckTransform(nn.Module):
        def __init__(self, width_in, width_out, stride, group_width, multiplier):
            super().__init__()
            w_b = int(round(width_out * multiplier))
            self.a = nn.Sequential(nn.Conv2d(width_in, w_b, 1, bias=False), nn.BatchNorm2d(w_b),
                                   nn.ReLU())
            self.b = nn.Sequential(nn.Conv2d(w_b, w_b, 3, stride=stride, padding=1,
                                             groups=w_b // group_width, bias=False),
                                   nn.BatchNorm2d(w_b), nn.ReLU())
            self.se = SqueezeExcitation(w_b, int(round(se_ratio * width_in)))
            self.c = nn.Conv2d(w_b, width_out, 1, bias=False)
            self.final_bn = nn.BatchNorm2d(width_out)

        def forward(self, x):
            return self.final_bn(self.c(self.se(self.b(self.a(x)))))

    class ResBottleneckBlock(nn.Module):
        def __init__(self, width_in, width_out, stride, group_width, multiplier):
            super().__init__()
            self.proj_block = width_in != width_out or stride != 1
            if self.proj_block:
                self.proj = nn.Conv2d(width_in, width_out, 1, stride=stride, bias=False)
                self.bn = nn.BatchNorm2d(width_out)
            self.f = BottleneckTransform(width_in, width_out, stride, group_width, multiplier)

        def forward(self, x):
            skip = self.bn(self.proj(x)) if self.proj_block else x
            return torch.relu(skip + self.f(x))

    class Stem(nn.Module):
        def __init__(self):
            super().__init__()
            stride = 1 if stem == "res_stem_cifar" else 2
            self.stem = nn.Sequential(nn.Conv2d(3, stem_width, 3, stride=stride, padding=1, bias=False),
                                      nn.BatchNorm2d(stem_width), nn.ReLU())

        def forward(self, x):
            return self.stem(x)

    blocks = [("conv1", Stem())]
    width_in = stem_width
    for i, (width, stride, depth, group_width, multiplier) in enumerate(stages):
        stage = nn.Sequential()
        for j in range(depth):
            stage.add_module(f"block{i + 1}-{j}", ResBottleneckBlock(
                width_in, width, stride if j == 0 else 1, group_width, multiplier))
            width_in = width
        blocks.append((f"res{i + 2}", stage))
    blocks += [("avgpool", nn.AdaptiveAvgPool2d((1, 1))), ("flatten", nn.Flatten(1)),
               ("fc", nn.Linear(width_in, classes))]
    return nn.Sequential(OrderedDict(blocks))
