"""ImageNet-1k (ILSVRC2012) facts the ResNet family's modules share, with no import of their own
(so that the family's declaration, its data modules and its task all read them without a
circle)."""

# Training images: one MLPerf ResNet epoch; turns LARS step counts into the epochs the LARS rules
# ask for.
IMAGENET_TRAIN_IMAGES = 1_281_167
