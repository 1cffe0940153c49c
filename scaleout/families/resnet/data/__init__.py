"""Image data for the ResNet family.

``synthetic.py`` (templates + noise: unit tests and throughput runs), ``folder.py`` (the
class-foldered ImageFolder layout, PIL decode and the MLPerf augmentation), ``batches.py`` (this
rank's micro-batches, the picklable recipe the prefetcher's workers run).
"""

from scaleout.families.resnet.data.batches import ImageBatches
from scaleout.families.resnet.data.folder import ImageFolder
from scaleout.families.resnet.data.synthetic import SyntheticImages

__all__ = ["ImageBatches", "ImageFolder", "SyntheticImages"]
