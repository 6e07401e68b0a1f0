"""EfficientNet in PyTorch, built as ClassyVision builds it (the trunk of VISSL's efficientnet
configs) with VISSL's feature-block names -- conv1, block0 ..., conv_final, avgpool, flatten,
dropout -- so that shardkit's nn::EfficientNet state dict loads into it strictly. Written from
the paper's and ClassyVision's description of the network: B0's seven stages of MBConv blocks,
each width times the width coefficient rounded to a multiple of 8 (never more than 10% down),
each stage's block count times the depth coefficient rounded up."""
import math
from collections import OrderedDict

# B0's stages: (blocks, kernel, stride, expansion, input width, output width)
B0_STAGES = [(1, 3, 1, 1, 32, 16), (2, 3, 2, 6, 16, 24), (2, 5, 2, 6, 24, 40),
             (3, 3, 2, 6, 40, 80), (3, 5, 1, 6, 80, 112), (4, 5, 2, 6, 112, 192),
             (1, 3, 1, 6, 192, 320)]


def efficientnet_in_torch(torch, width, depth, dropout=0.2, drop_connect=0.2, in_channels=3,
                          bn_momentum=0.01, bn_eps=1e-3, divisor=8):
    nn = torch.nn
    functional = torch.nn.functional

    def scaled(filters):
        target = filters * width
        channels = max(divisor, int(target + divisor / 2) // divisor * divisor)
        return channels + divisor if channels < 0.9 * target else channels

    def batch_norm(channels):
        return nn.BatchNorm2d(channels, eps=bn_eps, momentum=bn_momentum)

    class MBConv(nn.Module):
        def __init__(self, cin, cout, expansion, kernel, stride, rate):
            super().__init__()
            mid = cin * expansion
            self.expansion, self.rate = expansion, rate
            self.skip = stride == 1 and cin == cout
            if expansion != 1:
                self.expand_conv = nn.Conv2d(cin, mid, 1, bias=False)
                self.bn0 = batch_norm(mid)
            self.depthwise_conv = nn.Conv2d(mid, mid, kernel, stride, (kernel - 1) // 2,
                                            groups=mid, bias=False)
            self.bn1 = batch_norm(mid)
            squeeze = max(1, int(cin * 0.25))
            self.se_reduce = nn.Conv2d(mid, squeeze, 1)
            self.se_expand = nn.Conv2d(squeeze, mid, 1)
            self.project_conv = nn.Conv2d(mid, cout, 1, bias=False)
            self.bn2 = batch_norm(cout)

        def forward(self, x):
            y = x
            if self.expansion != 1:
                y = functional.silu(self.bn0(self.expand_conv(y)))
            y = functional.silu(self.bn1(self.depthwise_conv(y)))
            gate = self.se_expand(functional.silu(self.se_reduce(
                functional.adaptive_avg_pool2d(y, 1))))
            y = self.bn2(self.project_conv(y * torch.sigmoid(gate)))
            if not self.skip:
                return y
            if self.training and self.rate > 0:  # each sample's branch dropped with the rate
                keep = (torch.rand(y.shape[0], 1, 1, 1) >= self.rate).to(y.dtype)
                y = y * keep / (1 - self.rate)
            return y + x

    specs = []
    for blocks, kernel, stride, expansion, cin, cout in B0_STAGES:
        for b in range(int(math.ceil(depth * blocks))):
            specs.append((scaled(cin) if b == 0 else scaled(cout), scaled(cout), expansion, kernel,
                          stride if b == 0 else 1))
    children = [("conv1", nn.Sequential(nn.Conv2d(in_channels, scaled(32), 3, 2, 1, bias=False),
                                        batch_norm(scaled(32)), nn.SiLU()))]
    for i, (cin, cout, expansion, kernel, stride) in enumerate(specs):
        children.append((f"block{i}", MBConv(cin, cout, expansion, kernel, stride,
                                             drop_connect * i / len(specs))))
    features = scaled(1280)
    children += [("conv_final", nn.Sequential(nn.Conv2d(specs[-1][1], features, 1, bias=False),
                                              batch_norm(features), nn.SiLU())),
                 ("avgpool", nn.AdaptiveAvgPool2d(1)), ("flatten", nn.Flatten(1))]
    if dropout > 0:
        children.append(("dropout", nn.Dropout(dropout)))
    return nn.Sequential(OrderedDict(children))
