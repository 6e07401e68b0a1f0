"""torchvision's ResNet-18 in plain torch.nn (same parameter names), optionally with the
small-image stem (3x3 stride-1 conv, no max-pool): the PyTorch side of the ResNet-18 peer
benchmark (resnet18_torch_peer.py) and of tests/autograd/torch_interop.py. Needs torch."""
import torch
import torch.nn as nn


class BasicBlock(nn.Module):
    def __init__(self, inplanes, planes, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = None
        if stride != 1 or inplanes != planes:
            self.downsample = nn.Sequential(nn.Conv2d(inplanes, planes, 1, stride, bias=False),
                                            nn.BatchNorm2d(planes))

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        identity = x if self.downsample is None else self.downsample(x)
        return self.relu(out + identity)


class ResNet18(nn.Module):
    """torchvision's resnet18 layout (same parameter names), optionally with the small-image stem
    and narrower (base_channels instead of 64)."""

    def __init__(self, num_classes, small_image_stem, base_channels=64):
        super().__init__()
        c = base_channels
        if small_image_stem:
            self.conv1 = nn.Conv2d(3, c, 3, 1, 1, bias=False)
        else:
            self.conv1 = nn.Conv2d(3, c, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.Identity() if small_image_stem else nn.MaxPool2d(3, 2, 1)
        inplanes = c
        for i, planes in enumerate((c, 2 * c, 4 * c, 8 * c)):
            stride = 1 if i == 0 else 2
            setattr(self, f"layer{i + 1}", nn.Sequential(BasicBlock(inplanes, planes, stride),
                                                         BasicBlock(planes, planes, 1)))
            inplanes = planes
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(8 * c, num_classes)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def build_model(num_classes, small_image_stem, base_channels=64):
    if base_channels != 64:
        return ResNet18(num_classes, small_image_stem, base_channels), "plain torch.nn"
    try:
        import torchvision
    except ImportError:
        return ResNet18(num_classes, small_image_stem), "plain torch.nn"
    model = torchvision.models.resnet18(num_classes=num_classes)
    if small_image_stem:
        model.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
        model.maxpool = nn.Identity()
    return model, f"torchvision {torchvision.__version__}"
