"""Image data for the ResNet family.

``synthetic.py`` (templates + noise: unit tests and throughput runs), ``folder.py`` (the
class-foldered ImageFolder layout, PIL decode and the MLPerf augmentation), ``shards.py`` (tar
shards in the webdataset layout, static per-node shards), ``index.py`` (the lazy file index rank 0
builds and the other ranks read), ``prepare.py`` (``scaleout data prepare-imagenet``),
``batches.py`` (this rank's micro-batches, the picklable recipe the prefetcher's workers run).
docs/data-layouts.md.
"""

from scaleout.families.resnet.data.batches import ImageBatches
from scaleout.families.resnet.data.folder import ImageFolder
from scaleout.families.resnet.data.shards import NodeShardSampler, ShardImages
from scaleout.families.resnet.data.synthetic import SyntheticImages

__all__ = ["ImageBatches", "ImageFolder", "NodeShardSampler", "ShardImages", "SyntheticImages"]
