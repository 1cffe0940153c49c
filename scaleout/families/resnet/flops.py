"""ResNet's forward multiply-adds and parameters from the config, without building the model.

The one owner of ResNet's FLOP formula: the trainer's per-image FLOPs
(scaleout/families/resnet/task.py), the report and the simulator read it;
``tests/families/resnet/test_resnet_flops.py`` checks it against multiply-adds counted on the real
model (any ``bn_group``: batch-norm statistics change no multiply-add). One multiply-add = 2 FLOPs,
training = 3 x forward (backward computes input and weight gradients). ResNet-50 v1.5 at 224x224 is
4.09 G multiply-adds forward (v1.5 moves the stride to the 3x3 conv, which adds ~0.3 GMACs over v1's
3.8 G of He et al. 2015, Table 1), 25.6 M parameters.
"""

from __future__ import annotations

from scaleout.families.resnet.config import ResNetConfig

# depth -> (block type, blocks per stage) from He et al. 2015, Table 1
LAYERS: dict[int, tuple[str, tuple[int, int, int, int]]] = {
    18: ("basic", (2, 2, 2, 2)),
    34: ("basic", (3, 4, 6, 3)),
    50: ("bottleneck", (3, 4, 6, 3)),
    101: ("bottleneck", (3, 4, 23, 3)),
    152: ("bottleneck", (3, 8, 36, 3)),
}
EXPANSION = {"basic": 1, "bottleneck": 4}
STEM_MIN_IMAGE = 128  # from this size the stem is a 7x7/2 conv + 3x3/2 max pool, below a 3x3/1 conv


def _out(n: int, k: int, stride: int) -> int:
    return (n + 2 * (k // 2) - k) // stride + 1


def _walk(cfg: ResNetConfig) -> tuple[int, int, int]:
    """(forward multiply-adds per image, parameters, parameter tensors), layer by layer as model.py
    builds them."""
    macs = params = tensors = 0
    size = cfg.image_size

    def conv(cin: int, cout: int, k: int, stride: int = 1) -> None:
        nonlocal macs, params, tensors, size
        size = _out(size, k, stride)
        macs += size * size * cout * cin * k * k
        params += cout * cin * k * k + 2 * cout  # weight + the batch norm after it
        tensors += 3

    w = cfg.width
    if cfg.image_size >= STEM_MIN_IMAGE:
        conv(3, w, 7, 2)
        size = _out(size, 3, 2)  # max pool
    else:
        conv(3, w, 3)
    kind, blocks = LAYERS[cfg.depth]
    cin = w
    for i, n in enumerate(blocks):
        width = w * 2**i
        cout = width * EXPANSION[kind]
        for j in range(n):
            stride = 2 if (j == 0 and i > 0) else 1
            s0 = size
            if kind == "bottleneck":
                conv(cin, width, 1)
                conv(width, width, 3, stride)  # v1.5: stride on the 3x3
                conv(width, cout, 1)
            else:
                conv(cin, width, 3, stride)
                conv(width, cout, 3)
            if stride != 1 or cin != cout:
                s1, size = size, s0
                conv(cin, cout, 1, stride)
                size = s1
            cin = cout
    macs += cin * cfg.num_classes
    params += cin * cfg.num_classes + cfg.num_classes
    return macs, params, tensors + 2


def forward_macs(cfg: ResNetConfig) -> int:
    """Multiply-adds of one image's forward pass through the conv and linear layers."""
    return _walk(cfg)[0]


def training_flops_per_image(cfg: ResNetConfig) -> float:
    """Forward + backward FLOPs of one image: 3 passes x 2 FLOPs per multiply-add."""
    return 3.0 * 2.0 * forward_macs(cfg)


def resnet_params(cfg: ResNetConfig) -> int:
    """Trainable parameters: convolutions, batch-norm scales and shifts, the classifier."""
    return _walk(cfg)[1]


def resnet_param_tensors(cfg: ResNetConfig) -> int:
    return _walk(cfg)[2]
